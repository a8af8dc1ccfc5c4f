"""EAGLE-3 tree speculation: the drafter proposes a tree, the target verifies it in one call
and keeps the longest greedy path plus its own next token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from infer.candidates import Candidates
from infer.constraint import Constraint
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.head_drafter import EAGLE_DEFAULTS, HeadDrafter, TreeBudget
from infer.node_budget import NodeBudget
from infer.sampling import Sampler
from infer.session import MainSession
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop
from schemafill.toolcall import ToolRequest


class Drafter(Protocol):
    """``candidates`` tags each node with its source for cost-aware selection; a drafter with
    only ``draft(tokens, new_aux) -> (tokens, parents)`` is read as one source by depth."""

    def start(self, capacity: int) -> None: ...

    def candidates(self, tokens: list[int], new_aux: torch.Tensor) -> Candidates: ...


def candidates_of(drafter: Drafter, tokens: list[int], new_aux: torch.Tensor) -> Candidates:
    if hasattr(drafter, "candidates"):
        return drafter.candidates(tokens, new_aux)
    return Candidates.tree(*drafter.draft(tokens, new_aux), "draft")


def decode_tree(target: Target, tokenizer: Any, prompt: list[int], max_new_tokens: int, eos: frozenset[int],
                drafter: Drafter, scratch: int = 64, sampler: Sampler | None = None,
                constraint: Constraint | None = None, budget: NodeBudget | None = None,
                on_commit: Callable[[list[int]], None] | None = None, fmt: ResponseFormat = JSON) -> Decoded:
    """Draft, keep what ``budget`` finds worth its cost (everything without one), verify."""
    budget = budget or NodeBudget()
    s = MainSession(target, prompt, ResponseStop(tokenizer, eos, max_new_tokens, on_commit, fmt), scratch=scratch,
                    sampler=sampler, constraint=constraint)
    drafter.start(s.layout.positions)
    s.prefill()
    while not s.done:
        t = time.perf_counter()
        cand = budget.choose(candidates_of(drafter, s.tokens, s.new_aux), fixed_rows=len(s.tokens) - s.n_kv)
        budget.host(1e3 * (time.perf_counter() - t))
        budget.observe(cand, s.verify(cand.tokens, cand.parents))
    return s.decoded(head_forwards=getattr(drafter, "forwards", 0), head_ms=round(getattr(drafter, "ms", 0.0), 3))


@dataclass(frozen=True)
class Eagle3:
    """``decode_tree`` with the EAGLE-3 head's dynamic tree; scratch for the head's budget."""

    target: Target
    tokenizer: Any
    eos: frozenset[int]
    max_new_tokens: int
    drafter: HeadDrafter
    budget: NodeBudget
    fmt: ResponseFormat = JSON

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        return decode_tree(self.target, self.tokenizer, prompt, options.cap(self.max_new_tokens), self.eos,
                           self.drafter, scratch=self.drafter.budget.total, sampler=options.sampler,
                           constraint=options.constraint, budget=self.budget, on_commit=options.on_commit,
                           fmt=self.fmt)


def build(ctx: DecoderContext, method: str) -> Eagle3:
    """``eagle3`` at the decode budget; ``eagle3_wide`` at EAGLE's published defaults."""
    d = ctx.decode
    tree = TreeBudget.of(d) if method == "eagle3" else EAGLE_DEFAULTS
    nodes = ctx.budget()  # also prices the head's levels
    return Eagle3(ctx.target, ctx.tokenizer, ctx.eos, d.max_new_tokens, HeadDrafter(ctx.head, tree, nodes), nodes,
                  ctx.fmt)
