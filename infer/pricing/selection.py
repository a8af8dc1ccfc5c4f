"""Cost-aware node selection: which candidate nodes one verification carries.

Pure (``infer/rounds/tree.py``'s parent lists, no tensors). Each candidate node ``i`` has an estimated conditional
acceptance ``p[i]``: the chance the target's choice after its parent is its token, given the
parent was accepted (``infer/pricing/acceptance.py`` keeps those estimates). Greedy verification
accepts one path, so siblings are exclusive events and the tree's expected accepted tokens
are ``Σ v[i]`` with ``v[i] = p[i] · v[parent]`` (``v[root] = 1``): the chance node ``i`` is on
the accepted path. A round commits those plus the target's own token, and costs the
host-side work ``host_ms`` plus one forward over its rows, ``cost(rows)``. The set kept
maximises the round's expected committed tokens per millisecond::

    (1 + Σ_{kept} v) / (host_ms + cost(fixed + |kept|))

For a given size the best ancestor-closed set is the top nodes by ``v`` (``v`` never grows
along a path, and ties go to the shallower node), so one pass over the sorted nodes tries
every size; that is SpecExec's and Sequoia's greedy, with the size chosen by measured cost
instead of a fixed budget. Several trees (MAIN's and SIDE branches' segments) compete in
one call by passing them as one forest whose values share the same currency.

In a batch, one forward carries every request's rows: a request's nodes are priced as rows
of that call (``infer/rounds/share.Share``: the others' rows and expected tokens in the batch's
best call), so a node is kept only where its expected tokens beat what the batch's rows bring
per millisecond with it::

    (1 + others' tokens + Σ_{kept} v) / (host_ms + cost(others' rows + fixed + |kept|))
"""

from __future__ import annotations

from typing import Callable

from infer.rounds.tree import ROOT, clamped, depths


def path_values(parents: list[int], p: list[float]) -> list[float]:
    """``v[i] = p[i] · v[parent]``: the chance node i is on the accepted path."""
    v: list[float] = []
    for i, q in enumerate(p):
        q = min(max(q, 0.0), 1.0)
        v.append(q if parents[i] == ROOT else q * v[parents[i]])
    return v


def select(parents: list[int], values: list[float], cost: Callable[[int], float], fixed_rows: int = 1,
           host_ms: float = 0.0, max_nodes: int | None = None, keep: tuple[int, ...] = (), base: float = 1.0
           ) -> list[int]:
    """The node indices (sorted, closed under ancestors) worth verifying this round.

    ``values``: ``path_values`` (the expected accepted tokens each node adds); ``cost(n)``: ms
    of a forward over n rows; ``fixed_rows``: rows the call carries whatever is chosen (the
    pending tokens, SIDE steps already decided); ``keep``: nodes that must stay (their
    ancestors stay too), e.g. a chain the caller trusts more than its estimate; ``base``: the
    tokens the call commits whatever is chosen (the bonus token; in a batch, the others' too).
    """
    n = len(parents)
    depth = depths(parents)
    v = clamped(parents, values)
    forced: set[int] = set()
    for i in keep:
        while i != ROOT and i not in forced:
            forced.add(i)
            i = parents[i]
    order = sorted((i for i in range(n) if i not in forced), key=lambda i: (-v[i], depth[i], i))
    forced_gain = sum(v[i] for i in forced)
    rows = fixed_rows + len(forced)
    best_k, best = 0, (base + forced_gain) / (host_ms + cost(max(rows, 1)))
    gain = forced_gain
    limit = len(order) if max_nodes is None else max(0, min(len(order), max_nodes - len(forced)))
    for k in range(1, limit + 1):
        gain += v[order[k - 1]]
        rate = (base + gain) / (host_ms + cost(rows + k))
        if rate > best:
            best_k, best = k, rate
    return sorted(forced | set(order[:best_k]))


def expected_rate(values: list[float], kept: list[int], cost: Callable[[int], float], fixed_rows: int = 1,
                  host_ms: float = 0.0, base: float = 1.0) -> float:
    """Expected committed tokens per ms of verifying ``kept`` (what ``select`` maximises)."""
    return (base + sum(values[i] for i in kept)) / (host_ms + cost(fixed_rows + len(kept)))
