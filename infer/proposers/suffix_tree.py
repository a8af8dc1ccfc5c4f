"""Suffix decoding's data structure and speculation rule (SuffixDecoding, arXiv 2411.04975;
the rule as Arctic Inference implements it): a trie of every suffix of some token
sequences, each cut at ``max_depth`` tokens, where a node counts how often its token string
occurs, and a speculator that matches the context's tail in it and proposes the likeliest
continuations.

Speculation tries every tail length m = 1, 2, ... that the trie holds; a match of m tokens
may propose at most ``min(max_spec_tokens, int(m · factor + offset))`` tokens (the paper's
MAX_SPEC = α·p: longer matches earn longer drafts), each continuation's probability being
the product of child / parent counts along it, nothing under ``min_token_prob``. ``tree``
grows a best-first tree of those continuations; otherwise one path of most frequent
children. Of all tail lengths the draft with the highest score (its summed probabilities,
the expected accepted tokens) wins, a longer match on ties.
Pure: the standard library only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

ROOT = -1  # the parent of a draft's first tokens (as in infer/rounds/tree.py)


@dataclass
class Node:
    count: int = 0
    children: dict[int, "Node"] = field(default_factory=dict)


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    score: float = 0.0  # Σ probabilities of the drafted tokens
    match: int = 0  # tail tokens matched


class SuffixTree:
    """Suffixes of several sequences (each named by an id), extended token by token."""

    def __init__(self, max_depth: int = 24) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.sequences: dict[object, list[int]] = {}  # in the order they were first extended
        self.open: dict[object, list[Node]] = {}  # per sequence: nodes of its suffixes still < max_depth

    def extend(self, seq: object, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq`` (a new one if unseen): O(max_depth) per token."""
        held = self.sequences.setdefault(seq, [])
        frontier = self.open.setdefault(seq, [])
        for t in tokens:
            held.append(t)
            self.root.count += 1
            grown = []
            for node in [self.root] + frontier:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                child.count += 1
                grown.append(child)
            # shallowest first: the suffixes shorter than max_depth can still grow
            frontier[:] = grown[: self.max_depth - 1]

    def remove(self, seq: object) -> None:
        """Forget sequence ``seq``: its suffixes' counts go, and nodes left at zero."""
        tokens = self.sequences.pop(seq, None)
        self.open.pop(seq, None)
        if tokens is None:
            return
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for t in tokens[start:start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def __len__(self) -> int:
        return len(self.sequences)

    def speculate(self, context: list[int], max_spec_tokens: int, factor: float = 1.0, offset: float = 0.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> Draft:
        """The best draft for continuing ``context`` (empty when nothing matches)."""
        best = Draft([], [])
        for m in range(1, min(len(context), self.max_depth)):  # a tail shorter than the whole context
            node = _descend(self.root, context[-m:])
            if node is None:
                break
            budget = min(max_spec_tokens, int(m * factor + offset + 1e-6), self.max_depth - m)
            if budget <= 0:
                continue
            draft = (_tree if tree else _path)(node, budget, min_token_prob)
            draft.match = m
            if draft.tokens and draft.score >= best.score:
                best = draft
        return best


def _descend(node: Node | None, tokens: list[int]) -> Node | None:
    for t in tokens:
        if node is None:
            return None
        node = node.children.get(t)
    return node


def _path(node: Node, budget: int, min_prob: float) -> Draft:
    """The most frequent child at each step while its probability stays ≥ ``min_prob``."""
    tokens, parents, score, prob = [], [], 0.0, 1.0
    while len(tokens) < budget and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / node.count
        if prob < min_prob:
            break
        parents.append(len(tokens) - 1 if tokens else ROOT)
        tokens.append(token)
        score += prob
        node = child
    return Draft(tokens, parents, score)


def _tree(node: Node, budget: int, min_prob: float) -> Draft:
    """Best-first: the ``budget`` likeliest continuations (each ≥ ``min_prob``), as a tree."""
    tokens, parents, score = [], [], 0.0
    heap = [(-1.0, 0, ROOT, None, node)]  # (-probability, tie-break, parent index, token, node)
    order = 1
    while heap and len(tokens) < budget:
        neg, _, parent, token, at = heapq.heappop(heap)
        index = ROOT
        if token is not None:
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            score += -neg
        for t, child in at.children.items():
            p = -neg * child.count / at.count
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, index, t, child))
                order += 1
    return Draft(tokens, parents, score)
