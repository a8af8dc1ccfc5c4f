"""What the rest of a batched target call is, as one request prices its own rows
(``infer/pricing/selection.py``): the round loop (``loop.Batch``) says it, pricing reads it.
Pure: the standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """The rest of a batched call, as one request prices its own rows: the other requests'
    rows that bring this round's tokens (what one more row costs depends on them) and the tokens
    they are expected to commit (what the call brings besides this request's). Alone: nothing.

    A prompt's rows are left out: the prompt's KV is owed whatever anyone drafts, so charging it
    to the round would make a round beside a prompt look slow and every node in it look cheap
    by comparison (a round's rows then grow several times beyond what they earn)."""

    rows: int = 0
    tokens: float = 0.0


ALONE = Share()
