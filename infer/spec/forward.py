"""One target forward over several requests' calls: their rows packed one after another,
every projection run once over all of them, each request's rows attending only to its own
KV arena (``schemafill.runtime.Target.packed``). A request alone is a pack of one, so batch
1 and a batch are the same code.

A ``Call`` is what a request's ``MainSession`` builds (its rows and mask) and reads back
(``MainSession.take``); ``Output`` is its share of the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from schemafill.runtime import Part, Target
from schemafill.timing import sync


@dataclass
class Call:
    """One request's rows of a target call, and what reading its result back needs: ``kind``
    ``chunk`` (a piece of the prompt, KV only), ``prefill`` or ``verify``. Rows: the pending
    chain (at prefill, the rest of the prompt), MAIN's tree, the extra segments."""

    session: Any  # the ``MainSession`` that made it (its arena, and ``take``)
    kind: str
    tokens: list[int]
    positions: list[int]
    slots: list[int]  # arena slots each row writes
    visibility: torch.Tensor  # [T, S] the slots each row may see
    at: list[int]  # rows whose logits the call reads
    root_slot: int = 0
    tree_tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)  # each kept tree node's index in the proposal
    allowed: torch.Tensor | None = None  # [1 + m, V] the grammar's tokens at the root and each node
    extra: list[Segment] = field(default_factory=list)
    main_rows: int = 0  # rows before the extra segments (all of a chunk's)

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def extra_rows(self) -> int:
        return self.rows - self.main_rows

    @property
    def kv_rows(self) -> int:
        """MAIN rows that only write KV the request owes whatever is drafted (the prompt's, forced
        tokens' before the tree's root): no logits are read from them."""
        return self.main_rows if self.kind == "chunk" else self.main_rows - len(self.tree_tokens) - 1

    @property
    def priced_rows(self) -> int:
        """The rows that bring this round's tokens: what pricing charges a round with."""
        return self.rows - self.kv_rows


@dataclass
class Output:
    """A call's share of a target forward, and what the whole forward cost."""

    logits: torch.Tensor  # [len(at), V]
    aux: torch.Tensor  # [T, 3H]
    final: torch.Tensor  # [len(at), H]
    rows: int  # the forward's rows (every request's)
    extra_rows: int  # of them, extra-segment (SIDE) rows
    ms: float  # from building its inputs to its logits on the host


def run(target: Target, calls: list[Call]) -> list[Output]:
    """One forward over ``calls`` (each from a different request); their outputs, in order."""
    start = time.perf_counter()
    dev = target.device
    tokens, positions, at, parts, r = [], [], [], [], 0
    for c in calls:
        parts.append(Part(c.session.arena, r, torch.tensor(c.slots, device=dev), c.visibility.to(dev)))
        tokens += c.tokens
        positions += c.positions
        at += [r + i for i in c.at]
        r += c.rows
    f = target.packed(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), parts,
                      torch.tensor(at, dtype=torch.long, device=dev) if len(at) < r else None)
    logits, aux, final = f.logits[0], f.aux[0], f.final[0]  # [K, V], [N, 3H], [K, H]
    sync(dev)
    ms = 1e3 * (time.perf_counter() - start)
    total, extra = r, sum(c.extra_rows for c in calls)
    outs, r, k = [], 0, 0
    for c in calls:
        n = len(c.at)
        outs.append(Output(logits[k:k + n], aux[r:r + c.rows], final[k:k + n], rows=total, extra_rows=extra,
                           ms=ms))
        r, k = r + c.rows, k + n
    return outs


def run_alone(target: Target, call: Call) -> tuple[Call, Output]:
    """``call`` in a forward of its own."""
    return call, run(target, [call])[0]
