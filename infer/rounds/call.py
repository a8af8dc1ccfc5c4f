"""What one request puts into a round's target forward and gets back: its ``Call`` (the rows,
their slots and visibility, and what reading the result back needs), the ``Segment``s of extra
nodes it carries (SIDE branches), and its ``Output``, its share of the forward.

A request's ``MainSession`` builds its calls (``session.py``), ``forward.run`` runs every
request's call of a round in one target forward, and the session that built a call reads its
output back (``MainSession.take``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemafill.runtime.storage import KVArena


@dataclass
class Segment:
    """Extra nodes of one forward (a SIDE branch): each sees exactly ``visible[i]``."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    visible: list[list[int]]  # arena slots node i may attend to (its own slot included)
    decides: int | None = None  # the target's choice is read at the last this-many nodes only (None: all)

    @property
    def deciding(self) -> int:
        return len(self.tokens) if self.decides is None else min(self.decides, len(self.tokens))


@dataclass
class Call:
    """One request's rows of a target call, and what reading its result back needs: ``kind``
    ``chunk`` (a piece of the prompt, KV only), ``prefill`` or ``verify``. Rows: the pending
    chain (at prefill, the rest of the prompt), MAIN's tree, the extra segments."""

    arena: KVArena  # the request's own (row 0 is its sequence)
    kind: str  # chunk | prefill | verify
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


@dataclass
class Output:
    """A call's share of a target forward, and what the whole forward cost."""

    logits: torch.Tensor  # [len(at), V]
    aux: torch.Tensor  # [T, 3H]
    final: torch.Tensor  # [len(at), H]
    rows: int  # the forward's rows (every request's)
    extra_rows: int  # of them, extra-segment (SIDE) rows
    ms: float  # from building its inputs to its logits on the host
