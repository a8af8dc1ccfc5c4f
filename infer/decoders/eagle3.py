"""EAGLE-3 tree speculation: the drafter proposes a tree, the target verifies it in one call
and keeps the longest greedy path plus its own next token."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from infer.constraint import Constraint
from infer.decoders import Decoded
from infer.sampling import Sampler
from infer.session import MainSession
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop


class Drafter(Protocol):
    def start(self, capacity: int) -> None: ...

    def draft(self, tokens: list[int], new_aux: torch.Tensor) -> tuple[list[int], list[int]]: ...


def decode_tree(target: Target, tokenizer: Any, prompt: list[int], max_new_tokens: int, eos: frozenset[int],
                drafter: Drafter, scratch: int = 64, sampler: Sampler | None = None,
                constraint: Constraint | None = None) -> Decoded:
    s = MainSession(target, prompt, ResponseStop(tokenizer, eos, max_new_tokens), scratch=scratch, sampler=sampler,
                    constraint=constraint)
    drafter.start(len(prompt) + max_new_tokens + 1)
    s.prefill()
    while not s.done:
        tokens, parents = drafter.draft(s.tokens, s.new_aux)
        s.verify(tokens, parents)
    return s.decoded()
