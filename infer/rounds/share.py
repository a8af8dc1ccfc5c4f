"""What the rest of a batched target call is, as one request prices its own rows
(``infer/pricing/selection.py``): the round loop (``loop.Batch``) says it, pricing reads it.
Pure: the standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """The rest of a batched call, as one request prices its own rows: the rows the other
    requests carry whatever anyone drafts (their pending tokens) and the tokens those commit
    for sure, one a decoding request. A node is kept only where it beats what plain decoding
    of the batch brings per millisecond; the others' drafts are left out, or a batch that
    drafts heavily would price every node against its own low yield and keep drafting rows
    worth less than plain decoding's. Alone: nothing.

    A prompt's rows are left out: the prompt's KV is owed whatever anyone drafts, so charging it
    to the round would make a round beside a prompt look slow and every node in it look cheap
    by comparison (a round's rows then grow several times beyond what they earn)."""

    rows: int = 0
    tokens: float = 0.0


ALONE = Share()
