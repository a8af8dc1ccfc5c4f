"""One decoder's per-round choice of nodes: ``decode.select=cost`` keeps the
candidates worth their measured cost (``infer/pricing/selection.py`` against ``infer/pricing/cost_model.py``,
estimates from ``infer/pricing/acceptance.py``); ``decode.select=fixed`` verifies what the drafter
proposed, as the paper's fixed budget does.

Whatever it keeps, the target decides every committed token: selection changes only what is
proposed, and a proposal that depends only on the committed past keeps greedy decoding's
tokens and speculative sampling's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.pricing.acceptance import AcceptanceStats, head_source
from infer.pricing.cost_model import CostModel, LiveCost
from infer.pricing.selection import expected_rate, path_values, select
from infer.rounds.backoff import LAUNCH_HORIZON, DraftWorth
from infer.rounds.candidates import Candidates
from infer.rounds.share import ALONE, Share

if TYPE_CHECKING:
    from infer.rounds.session import Verified

EMA = 0.2  # weight of the newest round in the running means (host-side time, promised rate)


@dataclass
class NodeBudget:
    curve: CostModel | None = None  # the start-up curve; None: keep every candidate (the fixed budget)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    host_ms: float = 0.0  # running estimate of a round's host-side work (drafting, packing)
    fixed_host_ms: float | None = None  # a fixed estimate instead (selection independent of timing)
    rate: float = 0.0  # committed tokens per ms the chosen sets were expected to bring (running mean)
    cost: LiveCost | None = field(init=False, default=None)
    head_gain: float | None = None  # the head's tokens on the accepted path per round it drafted (running mean)
    # what drafting brought over the drafted rounds of the launch's requests (``rounds/backoff.py``)
    worth: DraftWorth = field(default_factory=lambda: DraftWorth(horizon=LAUNCH_HORIZON))

    def __post_init__(self) -> None:
        if self.fixed_host_ms is not None:
            self.host_ms = self.fixed_host_ms
        # what selection prices a call at: the curve, corrected by this decoder's own calls
        # (unless the host time is fixed too: then the kept nodes never depend on timing)
        self.cost = None if self.curve is None else LiveCost(self.curve, learn=self.fixed_host_ms is None)

    @property
    def active(self) -> bool:
        return self.cost is not None

    @property
    def adaptive(self) -> bool:
        """Selection that follows this host's timing (a cost model, host time measured): where
        the round loop may also stop a request's drafting that does not pay (``rounds/backoff.py``)."""
        return self.cost is not None and self.fixed_host_ms is None

    def choose(self, cand: Candidates, fixed_rows: int = 1, share: Share = ALONE,
               values: list[float] | None = None) -> Candidates:
        """The candidates this round verifies, with ``fixed_rows`` rows in the call regardless
        (pending tokens, other segments) and ``share`` from the rest of the batch; ``values``:
        theirs (``values``) where already computed this round."""
        if self.cost is None or not len(cand):
            return cand
        values = self.values(cand) if values is None else values
        return cand.subset(self.keep(cand.parents, values, fixed_rows, share=share))

    def keep(self, parents: list[int], values: list[float], fixed_rows: int, side: bool = False,
             share: Share = ALONE) -> list[int]:
        """``select`` against this budget's costs (of a call with SIDE rows when ``side``) and
        host time; the rate the kept set promises joins a running mean over rounds (what a
        drafter's next level must beat)."""
        kept, r = self.best(parents, values, fixed_rows, side, share)
        self.commit(r)
        return kept

    def best(self, parents: list[int], values: list[float], fixed_rows: int, side: bool = False,
             share: Share = ALONE) -> tuple[list[int], float]:
        """``keep``'s choice and the rate it promises, without joining the running mean."""
        cost = (lambda n: self.cost(n + share.rows, side)) if self.cost is not None else None
        base = 1.0 + share.tokens
        kept = select(parents, values, cost, fixed_rows, self.host_ms, base=base)
        return kept, expected_rate(values, kept, cost, fixed_rows, self.host_ms, base)

    def round_ms(self, rows: int, side: bool = False) -> float | None:
        """A round's milliseconds priced with a call of ``rows`` (with SIDE rows when ``side``),
        host work included; None for the fixed budget."""
        return None if self.cost is None else self.host_ms + self.cost(rows, side)

    def commit(self, rate: float) -> None:
        """The rate this round's chosen set promised joins the running mean."""
        self.rate = rate if not self.rate else (1 - EMA) * self.rate + EMA * rate

    def draft_rate(self, q: float) -> float:
        """How often a head draft of probability ``q`` has been accepted (its bucket's rate)."""
        return self.stats.rate(head_source(q))

    def level_worth(self, gain: float, ms: float) -> bool:
        """Is a drafting step that adds at most ``gain`` expected tokens for ``ms`` of host time
        worth it? Only when it beats the rate a round already promises. Without a cost
        model (the fixed budget) or with a fixed host estimate (selection independent of
        timing, for behaviour records), every step is."""
        if self.cost is None or self.fixed_host_ms is not None:
            return True
        return gain >= self.rate * ms

    def head_worth(self, ms: float) -> bool:
        """Is the head's drafting (``ms`` a round) worth the tokens its drafts bring? Always
        under the fixed budget or a fixed host estimate, and until it has been measured."""
        if self.cost is None or self.fixed_host_ms is not None or self.head_gain is None:
            return True
        return self.head_gain >= self.rate * ms

    def values(self, cand: Candidates) -> list[float]:
        """Each node's chance to be on the accepted path, by the current estimates."""
        return path_values(cand.parents, self.stats.rates(cand.sources))

    def observe(self, cand: Candidates, v: "Verified", head_drafted: bool = False) -> None:
        """What the verification of ``cand`` accepted (``head_drafted``: the head spent its time
        on this round), and what the call cost."""
        self.stats.observe(cand.parents, cand.sources, v.accepted)
        if head_drafted:
            gain = sum(cand.sources[i].startswith("head:") for i in v.accepted)
            self.head_gain = gain if self.head_gain is None else (1 - EMA) * self.head_gain + EMA * gain
        if self.cost is not None:
            self.cost.observe(v.rows, v.extra_rows > 0, v.ms)

    def host(self, ms: float) -> None:
        """One round's host-side milliseconds (outside the target call)."""
        if self.fixed_host_ms is not None:
            return
        self.host_ms = ms if not self.host_ms else (1 - EMA) * self.host_ms + EMA * ms

    def report(self) -> dict:
        """For metrics.json: the mode, the cost curve, host time, and each source's acceptance."""
        return {"select": "cost" if self.active else "fixed", "cost_model": self.cost.summary() if self.cost else None,
                "host_ms": round(self.host_ms, 3), "rate_per_ms": round(self.rate, 5),
                "head_tokens_per_round": None if self.head_gain is None else round(self.head_gain, 4),
                "sources": self.stats.table()}
