"""EAGLE-3 drafting: the head's own KV and its dynamic draft tree (EAGLE-2's expansion).

Per round, first the head catches up on the positions the target committed since the last
round, with the target's real features (training step 0): for each new position p the
pair (token p+1, ``fc(aux[p])``) at position p, written to head slot p. The last one
predicts the first draft level. Then the tree grows ``depth - 1`` levels: the ``topk``
most probable frontier nodes (by cumulative log-probability) are fed back with their
parent's output hidden state (training steps k > 0), each seeing the committed head KV and
its own ancestors only, and each proposes ``topk`` children. Finally the ``total`` best
nodes overall become the draft; cumulative scores never grow along a path, so that set is
closed under ancestors.

A level past the first costs a head forward of host time every round. Given a ``price``
(the decoder's cost-aware ``NodeBudget``), the tree stops growing when the next level's gain
— at most the frontier's chances to be accepted, by the measured acceptance of drafts the
head gives such probabilities — is not worth the milliseconds a level takes here (measured,
a running mean per drafter): on a 2-core CPU the deeper levels of the built-in head rarely
pay, on a GPU they are nearly free.

The same price decides whether the head drafts at all in a round: its catch-up and first
level cost a head forward of milliseconds, and a head whose drafts the target rarely takes
(measured: the head's tokens on the accepted path per round it drafted) is skipped while
those tokens are worth less than its time, drafting one round in ``SKIP_AT_MOST + 1`` to
keep measuring — from a request's first round on, whose catch-up over the whole prompt is
the dearest forward (a structured output the head was never trained on is done before its
first probe), unless SIDE drafts read the prompt's head entries that catch-up writes
(``prompt_first``). What a round's drafting costs is measured on rounds whose catch-up is
one round's (not a prompt's, nor a probe's over the rounds it skipped: a head priced by
those looks too dear to ever draft again). A skipped round's target features wait for the next
catch-up, so the head's KV is the same whenever it drafts.

Scratch head slots start right after the committed ones and are overwritten by the next
catch-up; nothing drafted ever enters the committed head KV.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generator, Protocol, TypeVar

import torch

from infer.pricing.acceptance import head_source
from infer.rounds.candidates import Candidates
from infer.rounds.session import MainSession
from infer.rounds.tree import ROOT
from schemafill.config import DecodeConfig
from schemafill.runtime.calls import causal_visibility
from schemafill.runtime.drafter import DraftPart, Eagle3Head, load_head
from schemafill.runtime.model import Target, rope_tables


@dataclass(frozen=True)
class TreeBudget:
    topk: int  # children per expanded node, and frontier width
    depth: int  # levels of the draft tree
    total: int  # draft nodes sent to verification

    def __post_init__(self) -> None:
        if min(self.topk, self.depth, self.total) < 1:
            raise ValueError(f"tree budget must be positive, got {self}")

    @classmethod
    def of(cls, decode: DecodeConfig) -> "TreeBudget":
        """The MAIN tree budget of a ``DecodeConfig``."""
        return cls(decode.topk, decode.depth, decode.total_tokens)


LEVEL_EMA = 0.2  # weight of the newest level in the running mean of a level's milliseconds
SKIP_AT_MOST = 7  # rounds a head not worth its time skips before it drafts again (to keep measuring)


class LevelPrice(Protocol):
    def draft_rate(self, q: float) -> float:
        """How often a draft the head gives probability ``q`` (given its parent) is accepted."""

    def level_worth(self, gain: float, ms: float) -> bool:
        """Is a level adding at most ``gain`` expected tokens worth ``ms`` of host time?"""

    def head_worth(self, ms: float) -> bool:
        """Is drafting this round (``ms`` of head time) worth what the head's drafts bring?"""


# the paper's SchemaFill budget, and EAGLE's own defaults
SCHEMAFILL_BUDGET = TreeBudget(topk=3, depth=2, total=8)  # the paper's: 8 draft tokens, top-k 3
EAGLE_DEFAULTS = TreeBudget(topk=10, depth=5, total=60)  # EAGLE's published defaults


T = TypeVar("T")
Steps = Generator["HeadStep", "HeadResult", T]  # drafting that yields its head forwards and returns T


@dataclass
class HeadResult:
    out: torch.Tensor  # [T, H] the step's output hidden states (of its part's ``outputs`` rows, when named)
    logits: torch.Tensor | None  # [len(logits_at), Vd] draft logits of the rows asked for
    ms: float  # this request's share of the forward


@dataclass
class HeadStep:
    """One head forward a request's drafting asks for (``rounds/loop.Step``): its rows
    (``part``; with ``fuse``, ``part.hidden`` holds target features [T, 3H_target] that the
    head's ``fc`` fuses first) and the rows whose draft logits it needs. The steps of every
    request in a round run as one forward: on a CPU or a GPU a head forward of a few rows
    costs what one of many rows does, so a batch drafts for the price of one request."""

    head: Eagle3Head
    part: DraftPart
    logits_at: list[int]  # rows of ``part`` (among its ``outputs`` when it names them)
    fuse: bool = False

    @property
    def key(self) -> int:
        return id(self.head)

    @property
    def rows(self) -> int:
        return len(self.part.input_ids)

    @staticmethod
    @torch.inference_mode()
    def run_together(steps: list["HeadStep"]) -> list[HeadResult]:
        """One forward of the head for ``steps`` (all of the same head), each request charged
        its rows' share of its time."""
        started = time.perf_counter()
        head = steps[0].head
        fused = [st for st in steps if st.fuse]
        hidden = iter(head.features(torch.cat([st.part.hidden for st in fused]).to(head.fc.weight.dtype))
                      .split([st.rows for st in fused]) if fused else [])  # [T_i, H] each
        outs = head.decode_packed([replace(st.part, hidden=next(hidden)) if st.fuse else st.part for st in steps])
        rows = [out[st.logits_at if st.part.outputs is None else [st.part.outputs.index(r) for r in st.logits_at]]
                for st, out in zip(steps, outs) if st.logits_at]
        # one LM head call for every step's rows; a lone step's rows as they are, so that
        # drafting alone runs exactly the operations it always has
        logits = iter(head.logits(torch.cat(rows)).split([len(r) for r in rows]) if len(rows) > 1
                      else [head.logits(r) for r in rows])
        ms = 1e3 * (time.perf_counter() - started) / sum(st.rows for st in steps)
        return [HeadResult(out, next(logits) if st.logits_at else None, ms * st.rows) for st, out in zip(steps, outs)]


def alone(steps: Steps[T]) -> T:
    """Run a request's drafting with its head forwards alone (outside a batch)."""
    try:
        step = next(steps)
        while True:
            step = steps.send(HeadStep.run_together([step])[0])
    except StopIteration as done:
        return done.value


class Clock:
    """A request's own drafting milliseconds when its head forwards run with other requests':
    its own work between steps, plus its share of each forward."""

    def __init__(self) -> None:
        self.spent, self.since = 0.0, time.perf_counter()

    def ms(self) -> float:
        return self.spent + 1e3 * (time.perf_counter() - self.since)

    def wait(self, step: HeadStep) -> Steps[HeadResult]:
        """Yield ``step``; its result, with the time in between counted as its share."""
        self.spent += 1e3 * (time.perf_counter() - self.since)
        res = yield step
        self.spent += res.ms
        self.since = time.perf_counter()
        return res


@dataclass
class HeadTimes:
    """What a launch has measured of its head's drafting on this host, shared by its requests'
    drafters: running means of one level past the first and of a round (0: not measured yet)."""

    level_ms: float = 0.0
    round_ms: float = 0.0


class HeadDrafter:
    """One request's drafting with the head (its head KV arena and catch-up state); a launch's
    requests share the head, its pricing and its ``HeadTimes``."""

    def __init__(self, head: Eagle3Head, budget: TreeBudget, price: LevelPrice | None = None,
                 times: HeadTimes | None = None, prompt_first: bool = False) -> None:
        self.head, self.budget, self.price = head, budget, price  # price None: every level is drafted
        # SIDE contexts read the prompt's head entries: such a request's first catch-up is never skipped
        self.prompt_first = prompt_first
        self.times = times or HeadTimes()
        self.device = head.fc.weight.device
        self.draft_to_target = head.draft_to_target.tolist()
        self.arena = None
        self.done = 0  # head KV holds positions [0, done)
        self.drafted = False  # the head drafted the latest proposal
        self.skipped = 0  # rounds skipped in a row
        self.waiting: list[torch.Tensor] = []  # target features of skipped rounds, for the next catch-up
        self.forwards, self.ms = 0, 0.0  # this request's head forwards and their milliseconds (with the logits)

    def begin(self, capacity: int, arena_slots: int = 0) -> None:
        """A new request: at most ``capacity`` committed positions; ``arena_slots``: at least
        this many head slots (SIDE contexts keep their head KV at their target slots)."""
        b = self.budget
        self.arena = self.head.new_arena(max(capacity + b.topk * max(b.depth - 1, 0) + 1, arena_slots))
        self.done, self.skipped, self.waiting = 0, 0, []
        self.forwards, self.ms = 0, 0.0

    # ---- drafting as steps: each head forward is yielded (``HeadStep``) so that a batch's
    # requests run theirs together (``HeadStep.run_together``); outside a batch, ``alone``
    def entry_steps(self, tokens: list[int], aux: list[torch.Tensor], positions: list[int], slots: list[int],
                    visible: list[list[int]], want: list[int]) -> Steps[list[int]]:
        """Head KV for contexts other than MAIN's (SIDE branches), in one forward: entry i is
        the training pair (``tokens[i]``, fc(``aux[i]``)) at ``positions[i]``, written to head
        slot ``slots[i]`` and seeing the head slots ``visible[i]``. Returns the head's most
        probable next token (a target id) after each entry listed in ``want``."""
        dev, clock = self.device, Clock()
        span = max(max(v) for v in visible) + 1
        vis = torch.zeros(len(tokens), span, dtype=torch.bool, device=dev)  # [N, S]
        for i, v in enumerate(visible):
            vis[i, v] = True
        res = yield from clock.wait(HeadStep(self.head, DraftPart(
            self.arena, torch.tensor(tokens, device=dev), torch.stack(aux), torch.tensor(positions, device=dev), vis,
            torch.tensor(slots, device=dev), outputs=sorted(set(want))), logits_at=want, fuse=True))
        drafts = [self.draft_to_target[d] for d in res.logits.argmax(-1).tolist()]
        self._count(1, clock.ms())
        return drafts

    # ---- as a round loop's proposer (``rounds/loop.Proposer``): the tree after MAIN's committed text
    def start(self, s: MainSession) -> None:
        self.begin(s.layout.positions)

    def propose(self, s: MainSession) -> Candidates:
        return alone(self.propose_steps(s))

    def idle(self, s: MainSession) -> None:
        """A round the request does not draft: its target features wait for the next catch-up."""
        self.drafted = False
        self.waiting.append(s.new_aux)

    def propose_steps(self, s: MainSession) -> Steps[Candidates]:
        return (yield from self.candidate_steps(s.tokens, s.new_aux))

    def finish(self, s: MainSession) -> dict:
        return {"head_forwards": self.forwards, "head_ms": round(self.ms, 3)}

    def candidates(self, tokens: list[int], new_aux: torch.Tensor, depth: int | None = None) -> Candidates:
        """``candidate_steps`` alone."""
        return alone(self.candidate_steps(tokens, new_aux, depth))

    def candidate_steps(self, tokens: list[int], new_aux: torch.Tensor, depth: int | None = None
                        ) -> Steps[Candidates]:
        """The draft tree, each node tagged with the bucket of the head's own probability for it
        (given its parent): what cost-aware selection reads as its acceptance estimate."""
        price, times = self.price, self.times
        self.drafted = False
        if price is not None and (self.done or not self.prompt_first) and self.skipped < SKIP_AT_MOST \
                and times.round_ms and not price.head_worth(times.round_ms):
            self.waiting.append(new_aux)
            self.skipped += 1
            return Candidates()
        # what drafting costs a round is measured where its catch-up is one round's: not over
        # a prompt, nor over the rounds a probe skipped
        usual = self.done > 0 and not self.waiting
        if self.waiting:
            new_aux = torch.cat([*self.waiting, new_aux])
        self.skipped, self.waiting = 0, []
        before = self.ms
        tree, parents, q = yield from self.scored_steps(tokens, new_aux, depth)
        ms = self.ms - before
        if usual:
            times.round_ms = ms if not times.round_ms else (1 - LEVEL_EMA) * times.round_ms + LEVEL_EMA * ms
        self.drafted = True
        return Candidates(tree, parents, [head_source(x) for x in q])

    def scored(self, tokens: list[int], new_aux: torch.Tensor, depth: int | None = None
               ) -> tuple[list[int], list[int], list[float]]:
        """``scored_steps`` alone."""
        return alone(self.scored_steps(tokens, new_aux, depth))

    def scored_steps(self, tokens: list[int], new_aux: torch.Tensor, depth: int | None = None
                     ) -> Steps[tuple[list[int], list[int], list[float]]]:
        """tokens: prompt + committed (the last ones pending: their target features do not
        exist yet); new_aux: [M, 3H] target features of the M newest positions that have them
        (those the head has not seen). The tree hangs off the last pending token, ``depth``
        levels deep (default: the budget's; each level past the first is a head forward),
        fewer when the drafter's price says a level is not worth its time (module docstring).
        Returns the tree and the head's probability of each node given its parent."""
        dev, b, price, times, clock = self.device, self.budget, self.price, self.times, Clock()
        h, m = self.done, new_aux.shape[0]
        n = h + m  # positions with target features; the first pending token sits at position n
        if not n < len(tokens):
            raise ValueError(f"features for {n} positions but only {len(tokens) - 1} committed tokens")
        pos = torch.arange(h, n, device=dev)  # [M]
        forced = len(tokens) - 1 - n  # pending tokens the grammar forced: they have no target features
        # the catch-up: every new position's head KV, the output of the newest alone (what drafts hang off)
        res = yield from clock.wait(HeadStep(self.head, DraftPart(
            self.arena, torch.tensor(tokens[h + 1:n + 1], device=dev), new_aux, pos, causal_visibility(pos[None], n)[0],
            pos, outputs=[m - 1]), logits_at=[] if forced else [m - 1], fuse=True))
        self.done = n
        forwards = 1  # the catch-up, then one per forced token and per level
        root_out = res.out[-1]  # [H]
        # forced tokens: the head reads them the way it reads its own drafts (its previous
        # output as the feature), in scratch slots the next catch-up overwrites
        for q in range(n, len(tokens) - 1):
            step = torch.tensor([q], device=dev)
            res = yield from clock.wait(HeadStep(self.head, DraftPart(
                self.arena, torch.tensor([tokens[q + 1]], device=dev), root_out[None], step,
                causal_visibility(step[None], q + 1)[0], step), logits_at=[] if q < len(tokens) - 2 else [0]))
            root_out = res.out[-1]
            forwards += 1
        n = len(tokens) - 1  # the tree's root: the last pending token

        # candidates: token, parent, cumulative log-prob, chance to be accepted (with a price);
        # fed nodes get a scratch slot and an output
        tok, parent, score, chance = [], [], [], []
        fed_slot: dict[int, int] = {}
        out_of: dict[int, torch.Tensor] = {}  # node -> its output hidden once fed

        def expand(parents_: list[int], logits: torch.Tensor, base: list[float]) -> list[int]:
            logp = torch.log_softmax(logits.float(), dim=-1)  # [F, Vd]
            top = logp.topk(min(b.topk, logp.shape[-1]), dim=-1)
            new = []
            for f, p in enumerate(parents_):
                for lp, d in zip(top.values[f].tolist(), top.indices[f].tolist()):
                    new.append(len(tok))
                    tok.append(self.draft_to_target[d])
                    parent.append(p)
                    score.append(base[f] + lp)
                    if price is not None:
                        chance.append(price.draft_rate(math.exp(lp)) * (1.0 if p == ROOT else chance[p]))
            return new

        frontier = expand([ROOT], res.logits, [0.0])
        slot = n + 1
        for d in range(1, b.depth if depth is None else min(depth, b.depth)):
            f_nodes = sorted(frontier, key=lambda i: (-score[i], i))[: b.topk]
            if price is not None and times.level_ms and not price.level_worth(sum(chance[i] for i in f_nodes),
                                                                              times.level_ms):
                break
            started = clock.ms()
            span = slot + len(f_nodes)
            visible = torch.zeros(len(f_nodes), span, dtype=torch.bool, device=dev)  # [F, S]
            visible[:, :n] = True
            for j, i in enumerate(f_nodes):
                fed_slot[i] = slot + j
                a = i
                while a != ROOT:
                    visible[j, fed_slot[a]] = True
                    a = parent[a]
            ins = torch.stack([root_out if parent[i] == ROOT else out_of[parent[i]] for i in f_nodes])  # [F, H]
            res = yield from clock.wait(HeadStep(self.head, DraftPart(
                self.arena, torch.tensor([tok[i] for i in f_nodes], device=dev), ins,
                torch.full((len(f_nodes),), n - 1 + d, device=dev), visible, torch.arange(slot, span, device=dev)),
                logits_at=list(range(len(f_nodes)))))
            for j, i in enumerate(f_nodes):
                out_of[i] = res.out[j]
            slot = span
            forwards += 1
            frontier = expand(f_nodes, res.logits, [score[i] for i in f_nodes])
            ms = clock.ms() - started
            times.level_ms = ms if not times.level_ms else (1 - LEVEL_EMA) * times.level_ms + LEVEL_EMA * ms

        self._count(forwards, clock.ms())
        chosen: set[int] = set()
        for i in sorted(range(len(tok)), key=lambda i: (-score[i], i)):
            if len(chosen) == b.total:
                break
            if parent[i] == ROOT or parent[i] in chosen:
                chosen.add(i)
        keep = sorted(chosen)  # creation order is topological
        index = {i: j for j, i in enumerate(keep)}
        q = [math.exp(score[i] - (0.0 if parent[i] == ROOT else score[parent[i]])) for i in keep]
        return [tok[i] for i in keep], [ROOT if parent[i] == ROOT else index[parent[i]] for i in keep], q

    def _count(self, forwards: int, ms: float) -> None:
        self.forwards += forwards
        self.ms += ms


def load_runtime_head(folder: str | Path, target: Target) -> Eagle3Head:
    """An exported head, attached to the runtime target's embeddings and rotary tables."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no EAGLE-3 head at {folder}: train one with `python train/run.py "
                                f"stages=[continuations,head]` or pass head=<folder>")
    head = load_head(folder, target.model.embed_tokens, *rope_tables(target.hf_config))
    want = list(target.config.aux_layer_ids)
    if list(head.config.aux_layer_ids) != want:
        raise ValueError(f"head at {folder} reads target layers {head.config.aux_layer_ids}, "
                         f"the runtime gives {want}: set model.aux_layer_ids to match")
    head = head.to(device=target.device, dtype=target.dtype).eval()
    head.steps = target.runs_on().draft_steps(head)  # e.g. replayed from graphs, as the target's calls are
    head.product = target.runs_on().head_product(head)  # e.g. the batch-invariant kernels' product
    return head
