"""One request on the target: its KV arena, the committed MAIN stream, and tree verification.

Arena layout (row 0): slots ``[0, n_kv)`` hold the prompt and the committed response in
position order; the newest committed token is *pending* (emitted, its KV not yet
computed) and is the root of the next verification; slots from ``n_kv`` on are scratch
for the tree under verification. Accepted nodes are moved down to the committed region,
rejected ones are simply overwritten by the next round.

Counters follow DESIGN §3: the prefill is one target call, every verification another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.tree import ancestor_mask, depths, greedy_accept
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop


@dataclass
class Verified:
    accepted: list[int]  # draft nodes on the accepted path, root-most first
    correction: int  # the target's own next token after them
    committed: int  # tokens that joined MAIN (≤ len(accepted) + 1 when the response stops)


@dataclass
class MainSession:
    target: Target
    prompt: list[int]
    stop: ResponseStop
    scratch: int = 64  # most tree nodes one verification may carry
    tokens: list[int] = field(default_factory=list)  # prompt + committed response (last one pending)
    n_kv: int = 0  # slots holding committed KV
    target_calls: int = 0
    nodes: list[int] = field(default_factory=list)  # tree nodes per verification
    new_aux: torch.Tensor | None = None  # [M, 3H] target features of the newest committed positions

    def __post_init__(self) -> None:
        capacity = len(self.prompt) + self.stop.max_new_tokens + self.scratch + 1
        self.arena = self.target.new_arena(1, capacity)
        self.device = self.target.device

    @property
    def done(self) -> bool:
        return self.stop.done

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    def prefill(self) -> None:
        """Prompt KV and the first response token (one target call)."""
        n = len(self.prompt)
        pos = torch.arange(n, device=self.device)[None]  # [1, P]
        visible = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None]  # [1, P, P]
        f = self.target(torch.tensor(self.prompt, device=self.device)[None], pos, visible, pos, self.arena)
        self.target_calls += 1
        first = int(f.logits[0, -1].argmax())
        self.tokens = list(self.prompt) + [first]
        self.n_kv = n
        self.new_aux = f.aux[0]  # [P, 3H]: every prompt position, for the drafter's first update
        self.stop.push([first])

    def verify(self, tree_tokens: list[int], parents: list[int]) -> Verified:
        """One target call over the pending root plus a draft tree; commit the greedy path."""
        if len(tree_tokens) > self.scratch:
            raise ValueError(f"a tree of {len(tree_tokens)} nodes exceeds the session's scratch of {self.scratch}")
        n, m = self.n_kv, len(tree_tokens)
        dev = self.device
        pos = torch.tensor([n] + [n + d for d in depths(parents)], device=dev)[None]  # [1, 1+M]
        slots = torch.arange(n, n + 1 + m, device=dev)[None]  # [1, 1+M]
        visible = torch.zeros(1 + m, n + 1 + m, dtype=torch.bool, device=dev)
        visible[:, : n + 1] = True  # committed rows and the root
        visible[1:, n + 1:] = ancestor_mask(parents).to(dev)
        f = self.target(torch.tensor([self.pending] + tree_tokens, device=dev)[None], pos, visible[None], slots,
                        self.arena)
        self.target_calls += 1
        self.nodes.append(m)
        choice = f.logits[0].argmax(-1).tolist()
        accepted, correction = greedy_accept(tree_tokens, parents, choice)
        self.arena.move(0, [n + 1 + i for i in accepted], [n + 1 + j for j in range(len(accepted))])
        new = [tree_tokens[i] for i in accepted] + [correction]
        taken = self.stop.push(new)
        self.tokens += new[:taken]
        self.n_kv = n + 1 + len(accepted)
        self.new_aux = f.aux[0, [0] + [1 + i for i in accepted]]  # [1+A, 3H]
        return Verified(accepted=accepted, correction=correction, committed=taken)

    @property
    def response(self) -> list[int]:
        return list(self.stop.ids)

