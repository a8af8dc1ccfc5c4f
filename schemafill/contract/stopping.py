"""The stopping rule every decoder shares (docs/design.md, "Contracts"): stop after the token that closes
the outer JSON object (a self-closing response format's end), at EOS, or at the length cap.

Speculative decoders commit several tokens per round; ``push`` says how many of them to
keep, so every method stops at exactly the token AR stops at — a requirement of the
lossless promise, not a detail.
"""

from __future__ import annotations

from typing import Any, Callable

from schemafill.contract.parser import ToolCallParser
from schemafill.contract.response_format import JSON, ResponseFormat


class ResponseStop:
    """Tracks one response's tokens and text; knows when the response is finished."""

    def __init__(self, tokenizer: Any, eos_ids: set[int] | frozenset[int], max_new_tokens: int,
                 on_push: Callable[[list[int]], None] | None = None, fmt: ResponseFormat = JSON) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.on_push = on_push  # told the response so far after every push that took tokens (streaming)
        self.eos_ids = frozenset(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.ids: list[int] = []
        self.reason: str | None = None  # closed | eos | length
        self._parser = ToolCallParser(fmt)
        self._fed = ""

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def text(self) -> str:
        return self.fmt.decode(self.tokenizer, self.ids)

    @property
    def parser(self) -> ToolCallParser:
        return self._parser

    @property
    def parsed_text(self) -> str:
        """The text the parser has seen (all of ``text`` but a split multi-byte tail)."""
        return self._fed

    def push(self, tokens: list[int]) -> int:
        """Append ``tokens`` until the response stops; return how many were taken."""
        taken = 0
        for tok in tokens:
            if self.done:
                break
            self.ids.append(int(tok))
            taken += 1
            if int(tok) in self.eos_ids:
                self.reason = "eos"
            else:
                self._check()
            if self.reason is None and len(self.ids) >= self.max_new_tokens:
                self.reason = "length"
        if taken and self.on_push is not None:
            self.on_push(self.ids)
        return taken

    def _check(self) -> None:
        """After a non-EOS token: set ``reason`` if the text now ends the response."""
        self._feed_text()
        if self.fmt.self_closing and self._parser.state.closed:
            self.reason = "closed"

    def _feed_text(self) -> None:
        text = self.fmt.decode(self.tokenizer, self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return
        if not text.startswith(self._fed):  # detokenization revised earlier text: parse afresh
            self._parser, self._fed = ToolCallParser(self.fmt), ""
        self._parser.feed(text[len(self._fed):])
        self._fed = text


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """Every id that ends a turn: the tokenizer's EOS and the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return frozenset(ids)
