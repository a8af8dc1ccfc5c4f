"""Token recycling (Luo et al., 2024), the drafter ToolSpec falls back on: a table of each
token's top-k next tokens, written from the target's own logits at every verified node and
kept across a launch's requests, read through a fixed tree template.

A template node is a path of column indices ``(c1, ..., cd)``: its token is column ``cd``
of the row of its parent's token (the root's for d = 1). ``TEMPLATE`` is the 80-node tree
ToolSpec and Token Recycling ship (8 first-level branches, depth 6; 8/21/25/15/8/3 nodes
per depth). Pure: torch and the tree module only.
"""

from __future__ import annotations

import torch

from infer.rounds.tree import ROOT, depths


def _paths() -> tuple[tuple[int, ...], ...]:
    d1 = [(c,) for c in range(8)]
    d2 = [(0, c) for c in range(8)] + [(1, c) for c in range(4)] + [(2, c) for c in range(3)] + \
         [(3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0)]
    d3 = [(0, 0, c) for c in range(8)] + [(0, 1, c) for c in range(3)] + [(0, 2, 0), (0, 2, 1)] + \
         [(0, c, 0) for c in range(3, 8)] + [(1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0)]
    d4 = [(0, 0, 0, c) for c in range(5)] + [(0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0),
                                             (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)]
    d5 = [(0, 0, 0, 0, c) for c in range(3)] + [(0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0), (0, 1, 0, 0, 0),
                                                (1, 0, 0, 0, 0)]
    d6 = [(0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0)]
    return tuple(d1 + d2 + d3 + d4 + d5 + d6)


TEMPLATE = _paths()


def template_tree(template: tuple[tuple[int, ...], ...] = TEMPLATE) -> tuple[list[int], list[int]]:
    """(parents, columns) of a template, breadth first: node i hangs off ``parents[i]`` and
    takes column ``columns[i]`` of its parent's row."""
    index = {p: i for i, p in enumerate(template)}
    if len(index) != len(template) or any(len(p) > 1 and p[:-1] not in index for p in template):
        raise ValueError("a template lists each path once, after its parent")
    return [index[p[:-1]] if len(p) > 1 else ROOT for p in template], [p[-1] for p in template]


class RecyclingTable:
    """[V, k] next-token candidates per token, zero until the target has been seen at it."""

    def __init__(self, vocab_size: int, k: int = 8, device: torch.device | str = "cpu") -> None:
        self.k = k
        self.next = torch.zeros(vocab_size, k, dtype=torch.long, device=device)  # [V, k]

    def update(self, tokens: list[int], logits: torch.Tensor) -> None:
        """Each token's row becomes the top-k of the target's logits at it. ``logits`` [N, V]."""
        self.next[torch.tensor(tokens, device=self.next.device)] = logits.topk(self.k, dim=-1).indices.to(
            self.next.device)

    def draft(self, root: int, parents: list[int], columns: list[int]) -> list[int]:
        """The template's tokens for a tree hanging off ``root``, filled depth by depth: one
        gather per depth on the table's device, one transfer at the end."""
        dev = self.next.device
        tokens = torch.zeros(len(parents) + 1, dtype=torch.long, device=dev)  # [1 + N]: the root, then the nodes
        tokens[0] = root
        for level in _levels(parents):
            at = torch.tensor(level, device=dev)
            above = torch.tensor([parents[i] + 1 for i in level], device=dev)  # the root is row 0
            tokens[at + 1] = self.next[tokens[above], torch.tensor([columns[i] for i in level], device=dev)]
        return tokens[1:].tolist()


def _levels(parents: list[int]) -> list[list[int]]:
    """Node indices grouped by depth, shallowest first."""
    out: list[list[int]] = []
    for i, d in enumerate(depths(parents)):
        while len(out) < d:
            out.append([])
        out[d - 1].append(i)
    return out
