"""Prompt lookup: drafts copied from text the request already holds (no model involved).

Tool-call values are mostly copied from the user's request ("Boston", "2024-05-01"), and
later calls repeat earlier ones' keys and units; a continuation found by suffix match
proposes such spans for free. Four matching rules live here:

* ``copy_match`` / ``copy_matches`` — SchemaFill's copies (MAIN chains): the longest suffix
  of up to ``n_max`` tokens, at its *last* occurrence in a source (and earlier ones that went
  another way).
* ``ngram_lookup`` — prompt-lookup (n-gram) decoding as vLLM's ``ngram`` proposer does it:
  the longest n in [n_min, n_max] whose trailing n-gram occurs earlier in the context, at
  its *earliest* occurrence, up to k tokens after it (``transformers``' prompt lookup is the
  same rule with n_min = 1).
* ``first_matches`` — ToolSpec's retrieval rule: n-grams of n_max down to n_min, every
  occurrence earliest first, in a source other than the context.
* ``text_copies`` — SchemaFill's copies of an open value by its *text*: a JSON string's words
  follow a quote, not the space they follow in the request's prose, so they are other tokens
  ("Seattle" after a quote is ``Se`` ``attle``, after a space `` Seattle``) and token lookup
  misses the copy that text lookup finds.

Pure: lists of token ids (or strings) in, lists out.
"""

from __future__ import annotations

from collections.abc import Iterator


def copy_match(context: list[int], source: list[int], n_max: int = 3, length: int = 8, overlap: bool = False,
               reach: int = 16) -> tuple[list[int], int]:
    """The tokens after the last occurrence in ``source`` of the longest suffix of ``context``
    (at most ``n_max`` tokens) found there ([] when none is), and how many tokens before the
    copy agree with the context's tail (the suffix found, followed further back; at most ``reach``; 0 when nothing is
    copied). A copy after a long agreement holds far more often than one after a single
    token (suffix decoding scores its candidates by the same evidence).

    ``overlap``: ``source`` is the context's own tail (the response so far), so a copy that
    reaches its end goes on with the tokens it has copied, as LZ77's overlapping copies do:
    text that repeats with period p (a response caught in a loop) is proposed ``length``
    tokens ahead, not just the p tokens left before the end."""
    found = copy_matches(context, source, n_max, length, overlap, reach, 1)
    return found[0] if found else ([], 0)


def copy_matches(context: list[int], source: list[int], n_max: int = 3, length: int = 8, overlap: bool = False,
                 reach: int = 16, most: int = 2) -> list[tuple[list[int], int]]:
    """Up to ``most`` copies (``copy_match``'s, then the continuations of earlier occurrences
    of the same suffix whose first token differs from every one before), latest first: where
    a response alternates between two continuations of the same text, both are proposed."""
    for n in range(min(n_max, len(context)), 0, -1):
        tail = context[-n:]
        found: list[tuple[list[int], int]] = []
        for start in range(len(source) - n - 1, -1, -1):  # leave at least one token to propose
            if source[start:start + n] != tail or any(c[0] == source[start + n] for c, _ in found):
                continue
            copied = source[start + n:start + n + length]
            if overlap:
                period = len(source) - start - n
                while len(copied) < length:
                    copied.append(copied[len(copied) - period])
            matched = n
            while matched < min(reach, start + n, len(context)) and \
                    source[start + n - matched - 1] == context[-matched - 1]:
                matched += 1
            found.append((copied, matched))
            if len(found) == most:
                break
        if found:
            return found
    return []


def ngram_lookup(context: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the context's
    longest trailing n-gram (``n_min`` ≤ n ≤ ``n_max``); [] when none occurs. The trailing
    n-gram itself does not count; an occurrence overlapping it does."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n-gram lookup needs 1 <= n_min <= n_max, got {n_min}, {n_max}")
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n):  # starts before the trailing n-gram's own
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def first_matches(context: list[int], source: list[int], n_min: int, n_max: int) -> Iterator[int]:
    """Where a continuation starts in ``source`` after an occurrence of the context's
    trailing n-gram: n from ``n_max`` down to ``n_min``, occurrences earliest first."""
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        tail = context[-n:]
        for start in range(len(source) - n):
            if source[start:start + n] == tail:
                yield start + n


NUMBER_CHARS = frozenset("0123456789.eE+-")


def text_copies(written: str, source: str, kind: str, length: int = 64, most: int = 3, reach: int = 32
                ) -> list[tuple[str, int]]:
    """Up to ``most`` continuations of an open value, of ``kind`` string or number, whose text
    so far is ``written``: the text after occurrences in ``source`` of written's longest suffix
    (at most ``reach`` characters), with how many characters matched. Where the whole value
    so far matches, an occurrence that starts a word comes first (a value copies a word, not
    the inside of one); then the latest first, each unless an earlier one already starts
    with it. A string's copy stops before a quote or a line break, a number's at its first
    character that no number has, and each at ``length`` characters; nothing is proposed
    when the longest suffix found is followed by nothing a value may go on with (the value
    ends there, in every copy)."""
    for n in range(min(reach, len(written)), 0, -1):
        tail = written[-n:]
        starts = []
        at = source.rfind(tail)
        while at >= 0:
            starts.append(at)
            at = source.rfind(tail, 0, at + n - 1) if at else -1
        if not starts:
            continue
        if n == len(written):  # word starts first, each group latest first (a stable sort)
            starts.sort(key=lambda a: a > 0 and source[a - 1].isalnum())
        found: list[tuple[str, int]] = []
        for a in starts:
            copied = _value_text(source[a + n:a + n + length], kind)
            if copied and all(not c.startswith(copied) for c, _ in found):
                found.append((copied, n))
                if len(found) == most:
                    break
        return found
    return []


def _value_text(text: str, kind: str) -> str:
    """The longest prefix of ``text`` that may go on a value of ``kind``."""
    end = 0
    if kind == "number":
        while end < len(text) and text[end] in NUMBER_CHARS:
            end += 1
    else:
        while end < len(text) and text[end] not in '"\n':
            end += 1
    return text[:end]
