"""Draft trees and greedy acceptance: pure functions over parent lists.

A draft tree is a list of nodes, each with a token and a parent index; parent -1 means
the node hangs off the *root*, the newest committed token whose logits the verification
forward also computes. Nodes are topologically ordered (a parent comes before its
children). Everything here is plain Python or torch on small tensors and is tested with
literal cases, the way vLLM tests its rejection sampler.
"""

from __future__ import annotations

import torch

ROOT = -1


def check_parents(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not ROOT <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come first (or be {ROOT}, the root)")


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for children of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def clamped(parents: list[int], values: list[float]) -> list[float]:
    """``values`` clamped down the tree: a child never outranks its parent, so ordering by
    value (shallower first on ties) makes every prefix of the order closed under ancestors."""
    v: list[float] = []
    for i, q in enumerate(parents):
        v.append(values[i] if q == ROOT else min(values[i], v[q]))
    return v


def ancestors(parents: list[int], i: int) -> list[int]:
    """Node i and its ancestors, root-most first (the root itself excluded)."""
    path = []
    while i != ROOT:
        path.append(i)
        i = parents[i]
    return path[::-1]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i may see node j iff j is i or one of i's ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p != ROOT:
            mask[i] |= mask[p]
    return mask


def leaves(parents: list[int]) -> list[int]:
    has_child = set(parents)
    return [i for i in range(len(parents)) if i not in has_child]


def paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path, as node indices."""
    return [ancestors(parents, leaf) for leaf in leaves(parents)]


def children(parents: list[int]) -> dict[int, list[int]]:
    """Children of each node (key ROOT for the root's), in node order."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def greedy_accept(tokens: list[int], parents: list[int], choice: list[int]) -> tuple[list[int], int]:
    """The longest path of draft nodes that greedy decoding would have produced, and the
    target's own next token after it (the correction, or the bonus when all match).

    ``choice[0]`` is the target's argmax at the root; ``choice[1 + i]`` its argmax at node i.
    Among siblings with the same token the first one wins (a well-formed tree has none).
    """
    kids = children(parents)
    accepted: list[int] = []
    node, want = ROOT, choice[0]
    while True:
        nxt = next((c for c in kids.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node, want = nxt, choice[1 + nxt]


def chain(tokens: list[int]) -> tuple[list[int], list[int]]:
    """A single-path tree: (tokens, parents)."""
    return list(tokens), [i - 1 if i else ROOT for i in range(len(tokens))]


def merge(trees: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """Union of several trees as one prefix tree: equal token paths share nodes.

    Used to verify several proposals (a drafter's tree, a packed chain) in one forward
    without sibling duplicates, which would waste nodes and confuse acceptance.
    """
    tokens, parents, _ = merge_indexed(trees)
    return tokens, parents


def merge_indexed(trees: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int], list[list[int]]]:
    """``merge``, plus for each input tree the output node each of its nodes became."""
    out_tokens: list[int] = []
    out_parents: list[int] = []
    maps: list[list[int]] = []
    index: dict[tuple[int, int], int] = {}  # (parent in output, token) -> output node
    for tokens, parents in trees:
        check_parents(parents)
        mapped: list[int] = []
        for tok, p in zip(tokens, parents):
            parent = ROOT if p == ROOT else mapped[p]
            key = (parent, tok)
            if key not in index:
                index[key] = len(out_tokens)
                out_tokens.append(tok)
                out_parents.append(parent)
            mapped.append(index[key])
        maps.append(mapped)
    return out_tokens, out_parents, maps


def prune(parents: list[int], keep: list[bool]) -> tuple[list[int], list[int]]:
    """The subtree of nodes that are kept and whose ancestors are all kept.

    Returns (index, new_parents): ``index[j]`` is the original node of new node j, and
    ``new_parents`` the parent list over the new numbering (still topological).
    """
    check_parents(parents)
    new_of: dict[int, int] = {ROOT: ROOT}
    index: list[int] = []
    new_parents: list[int] = []
    for i, p in enumerate(parents):
        if keep[i] and p in new_of:
            new_of[i] = len(index)
            index.append(i)
            new_parents.append(new_of[p])
    return index, new_parents
