"""Prompt prefixes shared across requests: the target's KV and features of prompts already
prefilled, and of conversations already answered, reused by a later prompt that starts with
the same tokens instead of computing them again.

What repeats in a server's traffic is the start of a prompt: a system prompt, the tool
catalog an agent sends every turn, and an agent's whole earlier conversation, which its next
turn extends — its earlier prompt, the answer the server gave, then the tool's result. So a
prompt is kept once prefilled and again with its answer once answered (the tokens whose KV the
request computed, up to its pending ones). A prompt's KV at position p depends only on the
tokens up to p, so a request whose prompt shares its first L tokens with a kept one starts with
those L slots copied and prefills the rest (at least its last token, whose logits choose the
first response token); an answer re-rendered into the next prompt shares tokens as far as it
is written the way it was generated. The head's drafting reads the target's features at every
position, so they are kept beside the KV.

Kept prompts are the most recently used ones within a byte budget; a prompt that extends a
kept one replaces it, and one a kept prompt already covers adds nothing. A copy of
milliseconds stands in for a prefill of a fraction of a second per thousand tokens on a CPU.
The copied KV is the KV this target computed for those tokens, so what a request decodes
is what it decodes without the cache wherever a position's KV does not depend on the call that
computed it (the batch-invariant backend: a prefill, its pieces, a decoding row and a verified
tree node compute a row alike; the loop's prompt pieces and verification rest on the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemafill.runtime.storage import KVArena

MIN_SHARED = 16  # fewer shared tokens than this are prefilled again (the copy's bookkeeping is not worth it)


@dataclass
class Prefix:
    tokens: tuple[int, ...]
    k: list[torch.Tensor]  # per layer [kv_heads, L, head_dim]
    v: list[torch.Tensor]
    aux: torch.Tensor  # [L, 3H] the target's features at each position
    used: int = 0  # when it was last kept or reused (a counter: least recently used goes first)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, self.aux))


def shared_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Kept prompt prefixes within ``budget_bytes`` (module docstring)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"a prefix cache's budget must be 0 or more bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.kept: list[Prefix] = []
        self.clock = 0
        self.reused_tokens = 0  # prompt tokens copied instead of prefilled, over every request

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.kept)

    def clear(self) -> None:
        """Forget every kept prefix (a bench starting each method's run cold)."""
        self.kept.clear()

    def longest(self, prompt: list[int]) -> tuple[Prefix, int] | None:
        """The kept prefix sharing the most leading tokens with ``prompt`` and how many it may
        give: all of them but the prompt's last, which the prefill computes for its logits.
        None when none shares ``MIN_SHARED`` tokens."""
        best, n = None, 0
        for p in self.kept:
            m = min(shared_length(p.tokens, prompt), len(prompt) - 1)
            if m > n:
                best, n = p, m
        if best is None or n < MIN_SHARED:
            return None
        self.clock += 1
        best.used = self.clock
        self.reused_tokens += n
        return best, n

    def keep(self, sequence: list[int], arena: KVArena, aux: torch.Tensor) -> None:
        """Keep ``sequence``'s KV (``arena``'s first ``len(sequence)`` slots of its row 0) and its
        features ``aux`` [len(sequence), 3H]: a prompt, or a prompt and its answer."""
        tokens = tuple(sequence)
        self.clock += 1
        for p in self.kept:
            if shared_length(p.tokens, tokens) == len(tokens):  # covered already: it stays fresh
                p.used = self.clock
                return
        n = len(tokens)
        entry = Prefix(tokens, *arena.prefix(n), aux[:n].clone(), self.clock)
        if entry.nbytes > self.budget:
            return
        # a kept prompt this one extends holds nothing the new entry does not
        self.kept = [p for p in self.kept if shared_length(p.tokens, tokens) < len(p.tokens)]
        self.kept.append(entry)
        while self.nbytes > self.budget:
            self.kept.remove(min(self.kept, key=lambda p: p.used))
