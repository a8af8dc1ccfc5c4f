"""What the rest of a batched target call is, as one request prices its own rows
(``infer/pricing/selection.py``): the round loop (``loop.Batch``) says it, pricing reads it.
Pure: the standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """The rest of a batched call, as one request prices its own rows: the other requests'
    rows (what one more row costs depends on them) and the tokens they are expected to commit
    (what the call brings besides this request's). Alone: nothing."""

    rows: int = 0
    tokens: float = 0.0


ALONE = Share()
