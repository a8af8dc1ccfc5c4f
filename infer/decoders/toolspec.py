"""ToolSpec, as its authors built it (hemingkx/ToolSpec): schema-FSM drafts, retrieval of
earlier outputs, token recycling (``proposers/toolspec.py``); learns across a launch's
requests."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.pricing.budget import NodeBudget
from infer.proposers.toolspec import ToolSpecDrafting, ToolSpecMemory
from infer.rounds.decoding import Runtime
from schemafill.config import ToolSpecConfig


def declare(rt: Runtime, cfg: ToolSpecConfig, budget: NodeBudget | None = None) -> Method:
    memory = ToolSpecMemory(cfg, rt.target.config.vocab_size, rt.target.device)
    def drafting(request, prompt):
        return ToolSpecDrafting(memory, request, rt.tokenizer, request.response_format(rt.fmt), budget)

    return Method(rt, drafting, budget, memory)


def build(ctx: DecoderContext, method: str) -> Method:
    return declare(ctx.runtime, ctx.decode.toolspec, ctx.budget())
