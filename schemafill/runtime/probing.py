"""The timed probe ``auto``'s choices between backends rest on: the decode loop's calls — a
call of n new rows after a few hundred committed positions — on each candidate backend, timed
in turn so that a busy or drifting host slows them alike. Each choice keeps its own margin and
cache (``compiled.choose``, ``batch_invariant.choose``)."""

from __future__ import annotations

import torch

from schemafill.runtime.calls import Backend
from schemafill.runtime.model import Target
from schemafill.runtime.timing import alternating_ms

CONTEXT = 512  # committed positions the probe's calls attend to


@torch.inference_mode()
def decode_ms(target: Target, backends: list[Backend], rows: tuple[int, ...] = (1,), repeats: int = 5) -> list[float]:
    """Milliseconds of decode calls on each backend: for each of ``rows``, a call of that many
    rows after ``CONTEXT`` positions, summed. Each backend prefills its own arena first, untimed."""
    width = CONTEXT + max(rows)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (1, width), generator=g)
    positions = torch.arange(width)[None]
    causal = torch.ones(width, width, dtype=torch.bool).tril()[None]
    context = slice(0, CONTEXT)
    calls = []
    for backend in backends:
        arena = backend.new_arena(1, width)
        backend.forward(tokens[:, context], positions[:, context], causal[:, context, context], positions[:, context],
                        arena)

        def decode(backend=backend, arena=arena) -> None:
            for r in rows:
                s = slice(CONTEXT, CONTEXT + r)
                backend.forward(tokens[:, s], positions[:, s], causal[:, s, :s.stop], positions[:, s], arena)

        calls.append(decode)
    return alternating_ms(calls, target.device, repeats)
