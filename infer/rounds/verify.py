"""Tree verification as pure steps (docs/design.md, "SchemaFill, step by step": attention and KV):
which arena rows each node of one target call sees, and the target's choice at each MAIN node.
The acceptance rule — the longest drafted path that matches those choices, plus the target's own
next token — is ``tree.greedy_accept``; ``session.MainSession`` runs the call and moves the
accepted rows.

A call carries, in order: the pending chain (committed tokens whose KV is not computed
yet; at prefill, the prompt), the MAIN draft tree hanging off the last of them, then any
extra segments (SIDE branches), each node of which names the rows it may see.
Pure: torch and the tree module only.
"""

from __future__ import annotations

import torch

from infer.rounds.sampling import History, Sampler
from infer.rounds.tree import ancestor_mask


def chain_and_tree(committed: int, chain: int, parents: list[int]) -> torch.Tensor:
    """[chain + m, committed + chain + m] visibility of a pending chain written at rows
    ``committed``.. and a tree of ``len(parents)`` nodes after it: everyone sees the
    committed rows, the chain is causal, each tree node sees the whole chain and its own
    ancestors (``parents`` index earlier nodes, ``ROOT`` = the chain's last token)."""
    n, L, m = committed, chain, len(parents)
    visible = torch.zeros(L + m, n + L + m, dtype=torch.bool)
    visible[:, :n] = True
    visible[:L, n:n + L] = torch.ones(L, L, dtype=torch.bool).tril()
    visible[L:, n:n + L] = True
    visible[L:, n + L:] = ancestor_mask(parents)
    return visible


def with_segments(visible: torch.Tensor, segments: list) -> torch.Tensor:
    """``visible`` [R, W] with one row per node of ``segments`` (each with ``visible``: the
    rows node i sees) below it, widened to the furthest row any node sees."""
    rows, width = visible.shape
    span = max([width] + [max(see) + 1 for seg in segments for see in seg.visible])
    mask = torch.zeros(rows + sum(len(seg.tokens) for seg in segments), span, dtype=torch.bool)
    mask[:rows, :width] = visible
    r = rows
    for seg in segments:
        for see in seg.visible:
            mask[r, see] = True
            r += 1
    return mask


def choose(logits: torch.Tensor, allowed: torch.Tensor | None, sampler: Sampler | None,
           history: History | None = None) -> list[int]:
    """The target's token at each MAIN node: among what the grammar ``allowed`` there
    ([N, V] booleans, or None), greedy or an independent draw (``sampler``), after the
    sampler's bias and the penalties of each node's ``history``. ``logits`` [N, V]."""
    if sampler is not None:
        logits = sampler.adjust(logits, history)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if sampler is None or sampler.greedy:
        return logits.argmax(-1).tolist()
    return sampler.draw(logits)
