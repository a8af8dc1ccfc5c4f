"""Token recycling: drafts copied from text the request already holds.

Tool-call values are mostly copied from the user's request ("Boston", "2024-05-01"), and
later calls repeat earlier ones' keys and units; a continuation looked up by suffix match
proposes such spans at no model cost. Used by ToolSpec's retrieval and by SchemaFill's
copy drafts (MAIN and SIDE). Pure: lists of token ids in, a list out.
"""

from __future__ import annotations


def recycle(context: list[int], source: list[int], n_max: int = 3, length: int = 8) -> list[int]:
    """The tokens after the last occurrence in ``source`` of the longest suffix of
    ``context`` (at most ``n_max`` tokens) found there; [] when none is."""
    for n in range(min(n_max, len(context)), 0, -1):
        tail = context[-n:]
        for start in range(len(source) - n - 1, -1, -1):  # leave at least one token to propose
            if source[start:start + n] == tail:
                return source[start + n:start + n + length]
    return []
