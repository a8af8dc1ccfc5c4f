"""One decoder's per-round choice of nodes (issue #23): ``decode.select=cost`` keeps the
candidates worth their measured cost (``infer/selection.py`` against ``infer/cost_model.py``,
estimates from ``infer/acceptance.py``); ``decode.select=fixed`` verifies what the drafter
proposed, as the paper's fixed budget does.

Whatever it keeps, the target decides every committed token: selection changes only what is
proposed, and a proposal that depends only on the committed past keeps greedy decoding's
tokens and speculative sampling's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.acceptance import AcceptanceStats, head_source
from infer.candidates import Candidates
from infer.cost_model import CostModel
from infer.selection import expected_rate, path_values, select

EMA = 0.2  # weight of the newest round in the running means (host-side time, promised rate)


@dataclass
class NodeBudget:
    cost: CostModel | None = None  # None: keep every candidate (the fixed budget)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    host_ms: float = 0.0  # running estimate of a round's host-side work (drafting, packing)
    fixed_host_ms: float | None = None  # a fixed estimate instead (selection independent of timing)
    rate: float = 0.0  # committed tokens per ms the chosen sets were expected to bring (running mean)

    def __post_init__(self) -> None:
        if self.fixed_host_ms is not None:
            self.host_ms = self.fixed_host_ms

    @property
    def active(self) -> bool:
        return self.cost is not None

    def choose(self, cand: Candidates, fixed_rows: int = 1) -> Candidates:
        """The candidates this round verifies, with ``fixed_rows`` rows in the call regardless
        (pending tokens, other segments)."""
        if self.cost is None or not len(cand):
            return cand
        return cand.subset(self.keep(cand.parents, self.values(cand), fixed_rows))

    def keep(self, parents: list[int], values: list[float], fixed_rows: int) -> list[int]:
        """``select`` against this budget's curve and host time; the rate the kept set promises
        joins a running mean over rounds (what a drafter's next level must beat)."""
        kept = select(parents, values, self.cost, fixed_rows, self.host_ms)
        r = expected_rate(values, kept, self.cost, fixed_rows, self.host_ms)
        self.rate = r if not self.rate else (1 - EMA) * self.rate + EMA * r
        return kept

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

    def values(self, cand: Candidates) -> list[float]:
        """Each node's chance to be on the accepted path, by the current estimates."""
        return path_values(cand.parents, self.stats.rates(cand.sources))

    def observe(self, cand: Candidates, accepted: list[int]) -> None:
        """What the verification of ``cand`` accepted (indices into it)."""
        self.stats.observe(cand.parents, cand.sources, accepted)

    def host(self, ms: float) -> None:
        """One round's host-side milliseconds (outside the target call)."""
        if self.fixed_host_ms is not None:
            return
        self.host_ms = ms if not self.host_ms else (1 - EMA) * self.host_ms + EMA * ms

    def report(self) -> dict:
        """For metrics.json: the mode, the cost curve, host time, and each source's acceptance."""
        return {"select": "cost" if self.active else "fixed", "cost_model": self.cost.summary() if self.cost else None,
                "host_ms": round(self.host_ms, 3), "rate_per_ms": round(self.rate, 5), "sources": self.stats.table()}
