"""What the rest of a batched target call is, as one request prices its own rows
(``infer/pricing/selection.py``): the round loop (``loop.Batch``) asks each request for its
``Offer`` and gives it its ``Share`` of the batch's best call (``batch_shares``). Pure: the
standard library and the tree functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from infer.rounds.tree import clamped, depths


@dataclass(frozen=True)
class Share:
    """The rest of a batched call, as one request prices its own rows: the rows the other
    requests carry (pending tokens and the drafts of the batch's best call, ``batch_shares``)
    and the tokens those are expected to commit. A node is kept only where it beats the rate
    the whole call reaches with it. Alone: nothing.

    A prompt's rows are left out: the prompt's KV is owed whatever anyone drafts, so charging it
    to the round would make a round beside a prompt look slow and every node in it look cheap
    by comparison (a round's rows then grow several times beyond what they earn)."""

    rows: int = 0
    tokens: float = 0.0


ALONE = Share()


@dataclass(frozen=True)
class Offer:
    """One request's part of a batched round as its selection prices it: its candidate forest
    (``parents``, each node's ``values``), the rows it carries whatever is chosen and the
    tokens it commits for sure (the bonus token)."""

    parents: list[int]
    values: list[float]
    fixed_rows: int = 1
    base: float = 1.0


def batch_shares(offers: list[Offer], round_ms: Callable[[int], float]) -> list[Share]:
    """What each request of a batched round prices its nodes against (``Share``): the rest of
    the batch's best call. That call takes every request's nodes in one order (by clamped
    value, as ``select`` orders one request's) and the size that maximises its expected
    committed tokens per millisecond, ``round_ms(n)`` being a round's host work and forward
    over ``n`` rows::

        (Σ base + Σ_{kept} v) / round_ms(Σ fixed + |kept|)

    Against it, a request's ``select`` keeps its own part of that optimum: a node only where it
    beats the rate the batch reaches *with* the others' best drafts (Dinkelbach's threshold). Priced
    against plain decoding of the others instead, every request keeps nodes that lower the
    batch's rate once all of them keep theirs."""
    merged: list[tuple[float, int, int]] = []  # (-value, depth, offer) over every request's nodes
    for j, offer in enumerate(offers):
        merged.extend((-v, d, j) for v, d in zip(clamped(offer.parents, offer.values), depths(offer.parents)))
    merged.sort()
    base = sum(o.base for o in offers)
    fixed = sum(o.fixed_rows for o in offers)
    best_k, best, gain = 0, base / round_ms(max(fixed, 1)), 0.0
    for k, (neg, _, _) in enumerate(merged, 1):
        gain -= neg
        rate = (base + gain) / round_ms(fixed + k)
        if rate > best:
            best_k, best = k, rate
    kept, gains = [0] * len(offers), [0.0] * len(offers)
    for neg, _, j in merged[:best_k]:
        kept[j] += 1
        gains[j] -= neg
    rows_of = [o.fixed_rows + k for o, k in zip(offers, kept)]
    tokens_of = [o.base + g for o, g in zip(offers, gains)]
    return [Share(sum(rows_of) - rows_of[j], sum(t for i, t in enumerate(tokens_of) if i != j))
            for j in range(len(offers))]
