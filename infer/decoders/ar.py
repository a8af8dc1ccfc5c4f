"""Autoregressive decoding: one token per target call (the baseline); greedy, or sampled
with a ``Sampler``."""

from __future__ import annotations

from typing import Any

from infer.constraint import Constraint
from infer.decoders import Decoded
from infer.sampling import Sampler
from infer.session import MainSession
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop


def decode_ar(target: Target, tokenizer: Any, prompt: list[int], max_new_tokens: int, eos: frozenset[int],
              sampler: Sampler | None = None, constraint: Constraint | None = None) -> Decoded:
    s = MainSession(target, prompt, ResponseStop(tokenizer, eos, max_new_tokens), scratch=0, sampler=sampler,
                    constraint=constraint)
    s.prefill()
    while not s.done:
        s.verify([], [])
    return s.decoded()
