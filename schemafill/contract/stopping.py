"""The stopping rule every decoder shares (docs/design.md, "Contracts"): stop after the token that closes
the outer JSON object (a self-closing response format's end), at EOS, at a client's stop sequence, or at
the length cap.

Speculative decoders commit several tokens per round; ``push`` says how many of them to
keep, so every method stops at exactly the token AR stops at — a requirement of the
lossless promise, not a detail. A stop sequence may end inside a token, and inside a block
of several accepted tokens: the response stops at the token that completes it, and its text
ends where the sequence begins (``visible``), as OpenAI's and vLLM's do.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from schemafill.contract.parser import ToolCallParser
from schemafill.contract.response_format import JSON, ResponseFormat


Logprob = tuple[float, list[tuple[int, float]]]  # a token's log-probability, and the top tokens' (id, logprob)


def visible(text: str, stops: Sequence[str], final: bool = True) -> str:
    """The part of ``text`` a client sees: up to the first stop sequence in it, and, while
    the response goes on (not ``final``), without a tail that may still become one."""
    if not stops:
        return text
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if final:
        return text
    hold = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)
    return text[:len(text) - hold]


class ResponseStop:
    """Tracks one response's tokens and text; knows when the response is finished."""

    def __init__(self, tokenizer: Any, eos_ids: set[int] | frozenset[int], max_new_tokens: int,
                 on_push: Callable[[list[int], list[Logprob] | None], None] | None = None,
                 fmt: ResponseFormat = JSON, stops: Sequence[str] = (), logprobs: bool = False) -> None:
        """``stops``: a client's stop sequences; ``logprobs``: keep each taken token's logprob
        (``push``'s ``scores``)."""
        self.tokenizer = tokenizer
        self.fmt = fmt
        # told the response so far (and its logprobs) after every push that took tokens (streaming)
        self.on_push = on_push
        self.eos_ids = frozenset(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.logprobs: list[Logprob] | None = [] if logprobs else None
        self.reason: str | None = None  # closed | eos | stop | length
        self._parser = ToolCallParser(fmt)
        self._fed = ""

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def text(self) -> str:
        return visible(self.fmt.decode(self.tokenizer, self.ids), self.stops)

    @property
    def parser(self) -> ToolCallParser:
        return self._parser

    @property
    def parsed_text(self) -> str:
        """The text the parser has seen (all of ``text`` but a split multi-byte tail)."""
        return self._fed

    def push(self, tokens: list[int], scores: list[Logprob] | None = None) -> int:
        """Append ``tokens`` until the response stops; return how many were taken. ``scores``:
        the tokens' logprobs, kept for those taken when the response keeps logprobs."""
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
        if self.logprobs is not None and scores is not None:
            self.logprobs.extend(scores[:taken])
        if taken and self.on_push is not None:
            self.on_push(self.ids, self.logprobs)
        return taken

    def _check(self) -> None:
        """After a non-EOS token: set ``reason`` if the text now ends the response."""
        seen = len(self._fed)
        self._feed_text()
        if self.fmt.self_closing and self._parser.state.closed:
            self.reason = "closed"
        elif any(s in self._fed[max(seen - len(s) + 1, 0):] for s in self.stops):  # only where new text ends it
            self.reason = "stop"

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
