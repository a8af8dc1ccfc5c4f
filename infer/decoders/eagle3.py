"""EAGLE-3 tree speculation: the drafter proposes a tree, the target verifies it in one call
and keeps the longest greedy path plus its own next token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from infer.constraint import Constraint
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.head_drafter import EAGLE_DEFAULTS, HeadDrafter, TreeBudget
from infer.sampling import Sampler
from infer.session import MainSession
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop
from schemafill.toolcall import ToolRequest


class Drafter(Protocol):
    def start(self, capacity: int) -> None: ...

    def draft(self, tokens: list[int], new_aux: torch.Tensor) -> tuple[list[int], list[int]]: ...


def decode_tree(target: Target, tokenizer: Any, prompt: list[int], max_new_tokens: int, eos: frozenset[int],
                drafter: Drafter, scratch: int = 64, sampler: Sampler | None = None,
                constraint: Constraint | None = None) -> Decoded:
    s = MainSession(target, prompt, ResponseStop(tokenizer, eos, max_new_tokens), scratch=scratch, sampler=sampler,
                    constraint=constraint)
    drafter.start(s.layout.positions)
    s.prefill()
    while not s.done:
        tokens, parents = drafter.draft(s.tokens, s.new_aux)
        s.verify(tokens, parents)
    return s.decoded()


@dataclass(frozen=True)
class Eagle3:
    """``decode_tree`` with the EAGLE-3 head's dynamic tree; scratch for the head's budget."""

    target: Target
    tokenizer: Any
    eos: frozenset[int]
    max_new_tokens: int
    drafter: HeadDrafter

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        return decode_tree(self.target, self.tokenizer, prompt, self.max_new_tokens, self.eos, self.drafter,
                           scratch=self.drafter.budget.total, sampler=options.sampler, constraint=options.constraint)


def build(ctx: DecoderContext, method: str) -> Eagle3:
    """``eagle3`` at the decode budget; ``eagle3_wide`` at EAGLE's published defaults."""
    d = ctx.decode
    budget = TreeBudget.of(d) if method == "eagle3" else EAGLE_DEFAULTS
    return Eagle3(ctx.target, ctx.tokenizer, ctx.eos, d.max_new_tokens, HeadDrafter(ctx.head, budget))
