"""Suffix decoding (SuffixDecoding; Arctic Inference's vLLM plugin): drafts from suffix trees of
the request and of the launch's earlier responses (``proposers/suffix.py``). No trained
drafter; lossless at temperature 0 and exact under sampling."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.pricing.budget import NodeBudget
from infer.proposers.suffix import SuffixMemory, SuffixProposer
from infer.rounds.decoding import Runtime
from infer.rounds.loop import Proposing
from schemafill.config import SuffixConfig


def declare(rt: Runtime, cfg: SuffixConfig, budget: NodeBudget | None = None) -> Method:
    memory = SuffixMemory(cfg)

    def drafting(request, prompt):
        return Proposing(SuffixProposer(cfg, memory.admit(request.id), request.id), cfg.num_speculative_tokens,
                         budget)

    return Method(rt, drafting, budget, memory)


def build(ctx: DecoderContext, method: str) -> Method:
    return declare(ctx.runtime, ctx.decode.suffix, ctx.budget())
