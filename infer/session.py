"""One request on the target: its KV arena, the committed MAIN stream, and tree verification.

Arena layout (row 0), DESIGN §4.6:

* ``[0, P)`` the prompt, shared and read-only once written;
* ``[P, n_kv)`` the committed response, in position order (accepted rows are moved down
  here); the newest committed token is *pending* (emitted, its KV not yet computed) and
  is the root of the next verification;
* ``[n_kv, ...)`` scratch for the MAIN tree under verification, overwritten next round;
* ``[side_base, capacity)`` a pool for SIDE rows, which the SchemaFill decoder allocates
  and frees; a SIDE row never moves into MAIN.

One target call verifies the MAIN tree and any number of extra segments (SIDE branches):
each extra node names the arena slots it may see, so MAIN never sees a SIDE row, a SIDE
node sees only the prompt and its own branch, and siblings never see each other.
Counters follow DESIGN §3: the prefill is one target call, every verification another.
At temperature > 0 the target's choice at each MAIN node is a draw from its distribution
(``Sampler``), which keeps the committed tokens distributed exactly as serial sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.constraint import Constraint
from infer.sampling import Sampler
from infer.tree import ancestor_mask, depths, greedy_accept
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop


@dataclass
class Segment:
    """Extra nodes of one forward (a SIDE branch): each sees exactly ``visible[i]``."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    visible: list[list[int]]  # arena slots node i may attend to (its own slot included)


@dataclass
class Verified:
    accepted: list[int]  # MAIN draft nodes on the accepted path, root-most first
    correction: int  # the target's own next token after them
    committed: int  # tokens that joined MAIN (≤ len(accepted) + 1 when the response stops)
    extra_choices: list[list[int]] = field(default_factory=list)  # target argmax at each extra node
    extra_aux: list[torch.Tensor] = field(default_factory=list)  # [n, 3H] target features at each extra node


@dataclass
class MainSession:
    target: Target
    prompt: list[int]
    stop: ResponseStop
    scratch: int = 64  # most MAIN tree nodes one verification may carry
    side_capacity: int = 0  # arena rows for SIDE branches
    tokens: list[int] = field(default_factory=list)  # prompt + committed response (last one pending)
    n_kv: int = 0  # slots holding committed KV
    target_calls: int = 0
    nodes: list[int] = field(default_factory=list)  # tree nodes (MAIN + SIDE) per verification
    new_aux: torch.Tensor | None = None  # [M, 3H] target features of the newest committed positions
    peak_rows: int = 0  # most arena rows live in one call: committed + tree + SIDE (reserved spare excluded)
    prompt_aux: torch.Tensor | None = None  # [3H] target features at the prompt's last position
    sampler: Sampler | None = None  # how MAIN picks its token at each node (None: greedy)
    constraint: Constraint | None = None  # the response grammar MAIN's choices obey (None: free)

    def __post_init__(self) -> None:
        self.side_base = len(self.prompt) + self.stop.max_new_tokens + self.scratch + 1
        self.arena = self.target.new_arena(1, self.side_base + self.side_capacity)
        self.device = self.target.device

    @property
    def done(self) -> bool:
        return self.stop.done

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def response(self) -> list[int]:
        return list(self.stop.ids)

    def prefill(self, tree_tokens: list[int] = (), parents: list[int] = (), extra: list[Segment] = ()) -> Verified:
        """The prompt, optionally with a MAIN tree hanging off its last token and extra
        segments, in one target call; commits the greedy path and the first correction."""
        p = len(self.prompt)
        tree_tokens, parents = list(tree_tokens), list(parents)
        pos = list(range(p)) + [p - 1 + d for d in depths(parents)]
        visible = torch.zeros(p + len(tree_tokens), p + len(tree_tokens), dtype=torch.bool)
        visible[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        visible[p:, :p] = True
        visible[p:, p:] = ancestor_mask(parents)
        return self._run(self.prompt + tree_tokens, pos, list(range(p + len(tree_tokens))), visible, p - 1,
                         tree_tokens, parents, extra, prefill=True)

    def verify(self, tree_tokens: list[int], parents: list[int], extra: list[Segment] = ()) -> Verified:
        """One target call over the pending root plus a MAIN draft tree (and extra segments)."""
        if len(tree_tokens) > self.scratch:
            raise ValueError(f"a tree of {len(tree_tokens)} nodes exceeds the session's scratch of {self.scratch}")
        n, m = self.n_kv, len(tree_tokens)
        pos = [n] + [n + d for d in depths(parents)]
        visible = torch.zeros(1 + m, n + 1 + m, dtype=torch.bool)
        visible[:, : n + 1] = True  # committed rows and the root
        visible[1:, n + 1:] = ancestor_mask(parents)
        return self._run([self.pending] + tree_tokens, pos, list(range(n, n + 1 + m)), visible, n,
                         tree_tokens, parents, extra, prefill=False)

    def _run(self, tokens: list[int], positions: list[int], slots: list[int], visible: torch.Tensor, root_slot: int,
             tree_tokens: list[int], parents: list[int], extra: list[Segment], prefill: bool) -> Verified:
        """Append the extra segments, run the target once, commit MAIN's greedy path."""
        main_rows, width = visible.shape
        span = max([width] + [max(see) + 1 for seg in extra for see in seg.visible])
        rows = main_rows + sum(len(seg.tokens) for seg in extra)
        mask = torch.zeros(rows, span, dtype=torch.bool)
        mask[:main_rows, :width] = visible
        r = main_rows
        for seg in extra:
            for see in seg.visible:
                mask[r, see] = True
                r += 1
            tokens = tokens + seg.tokens
            positions = positions + seg.positions
            slots = slots + seg.slots
        dev = self.device
        # no token before the root needs logits: at prefill this skips the prompt's LM head
        # (for the built-in target, 28M of its 135M weights: about a fifth of the prefill)
        first = main_rows - len(tree_tokens) - 1
        f = self.target(torch.tensor(tokens, device=dev)[None], torch.tensor(positions, device=dev)[None],
                        mask.to(dev)[None], torch.tensor(slots, device=dev)[None], self.arena,
                        logits_at=torch.arange(first, rows, device=dev)[None] if first else None)
        logits = f.logits[0]  # [rows - first, V]: the root, MAIN's tree, then the extra segments
        self.target_calls += 1
        self.nodes.append(rows - main_rows + len(tree_tokens))
        side = {s for seg in extra for see in seg.visible for s in see if s >= self.side_base}
        self.peak_rows = max(self.peak_rows, max(slots[:main_rows]) + 1 + len(side))
        choice = logits.argmax(-1).tolist()  # SIDE nodes are proposals: always greedy and free
        first_tree = first + 1  # index of the first MAIN tree node in this call
        main_logits = logits[: main_rows - first]  # [1 + m, V]: the root and MAIN's tree
        if self.constraint is not None:  # each node chooses among what the grammar allows after its path
            allowed = self.constraint.masks(tree_tokens, parents).to(main_logits.device)
            main_logits = main_logits.masked_fill(~allowed, float("-inf"))
        if self.sampler is None or self.sampler.greedy:
            main_choice = choice[: main_rows - first] if self.constraint is None else main_logits.argmax(-1).tolist()
        else:  # an independent draw at every MAIN node: exact speculative sampling (infer/sampling.py)
            main_choice = self.sampler.choose(main_logits)
        accepted, correction = greedy_accept(tree_tokens, parents, main_choice)
        base = root_slot + 1  # committed MAIN continues right after the root
        self.arena.move(0, [slots[first_tree + i] for i in accepted], [base + j for j in range(len(accepted))])
        new = [tree_tokens[i] for i in accepted] + [correction]
        taken = self.stop.push(new)
        if self.constraint is not None:
            self.constraint.advance(new[:taken])
        if prefill:
            self.prompt_aux = f.aux[0, len(self.prompt) - 1]
            self.tokens = list(self.prompt) + new[:taken]
            self.new_aux = f.aux[0, list(range(len(self.prompt))) + [first_tree + i for i in accepted]]
        else:
            self.tokens += new[:taken]
            self.new_aux = f.aux[0, [0] + [1 + i for i in accepted]]  # [1+A, 3H]
        self.n_kv = base + len(accepted)
        extra_choices, extra_aux, r = [], [], main_rows
        for seg in extra:
            extra_choices.append(choice[r - first:r - first + len(seg.tokens)])
            extra_aux.append(f.aux[0, r:r + len(seg.tokens)])
            r += len(seg.tokens)
        return Verified(accepted=accepted, correction=correction, committed=taken, extra_choices=extra_choices,
                        extra_aux=extra_aux)
