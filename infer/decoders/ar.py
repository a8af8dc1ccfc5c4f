"""Autoregressive decoding: one token per target call (the baseline); greedy, or sampled
with a ``Sampler``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from infer.constraint import Constraint
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.sampling import Sampler
from infer.session import MainSession
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop
from schemafill.toolcall import ToolRequest


def decode_ar(target: Target, tokenizer: Any, prompt: list[int], max_new_tokens: int, eos: frozenset[int],
              sampler: Sampler | None = None, constraint: Constraint | None = None,
              on_commit: Callable[[list[int]], None] | None = None, fmt: ResponseFormat = JSON) -> Decoded:
    s = MainSession(target, prompt, ResponseStop(tokenizer, eos, max_new_tokens, on_commit, fmt), scratch=0,
                    sampler=sampler,
                    constraint=constraint)
    s.prefill()
    while not s.done:
        s.verify([], [])
    return s.decoded()


@dataclass(frozen=True)
class AR:
    target: Target
    tokenizer: Any
    eos: frozenset[int]
    max_new_tokens: int
    fmt: ResponseFormat = JSON

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        return decode_ar(self.target, self.tokenizer, prompt, options.cap(self.max_new_tokens), self.eos,
                         options.sampler, options.constraint, options.on_commit, self.fmt)


def build(ctx: DecoderContext, method: str) -> AR:
    return AR(ctx.target, ctx.tokenizer, ctx.eos, ctx.decode.max_new_tokens, ctx.fmt)
