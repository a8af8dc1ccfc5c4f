"""One target forward over several requests' calls (``call.py``): their rows packed one after
another, every projection run once over all of them, each request's rows attending only to its
own KV arena (``Target.packed``). A request alone is a pack of one, so batch 1 and a batch are
the same code.
"""

from __future__ import annotations

import time

import torch

from infer.rounds.call import Call, Output
from schemafill.runtime.calls import Part
from schemafill.runtime.model import Target
from schemafill.runtime.timing import sync


def run(target: Target, calls: list[Call]) -> list[Output]:
    """One forward over ``calls`` (each from a different request); their outputs, in order."""
    start = time.perf_counter()
    dev = target.device
    tokens, positions, at, parts, r = [], [], [], [], 0
    for c in calls:
        parts.append(Part(c.arena, r, torch.tensor(c.slots, device=dev), c.visibility.to(dev)))
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
