"""Prompt-lookup (n-gram) decoding, as vLLM's ``ngram`` speculative method: no trained drafter;
lossless at temperature 0 and exact under sampling (the draft depends only on committed
tokens)."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.pricing.budget import NodeBudget
from infer.proposers.ngram import NgramProposer
from infer.rounds.decoding import Runtime
from infer.rounds.loop import Proposing
from schemafill.config import NgramConfig


def declare(rt: Runtime, cfg: NgramConfig, budget: NodeBudget | None = None) -> Method:
    proposer = NgramProposer(cfg)
    return Method(rt, lambda request, prompt: Proposing(proposer, cfg.num_speculative_tokens, budget), budget)


def build(ctx: DecoderContext, method: str) -> Method:
    return declare(ctx.runtime, ctx.decode.ngram, ctx.budget())
