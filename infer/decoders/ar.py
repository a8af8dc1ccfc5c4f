"""Autoregressive decoding, the baseline: nothing proposed, one token per target call;
greedy, or sampled with the request's ``Sampler``."""

from __future__ import annotations

from infer.decoders.context import DecoderContext
from infer.decoders.method import Method
from infer.rounds.decoding import Runtime
from infer.rounds.loop import Drafting


def declare(rt: Runtime) -> Method:
    return Method(rt, lambda request, prompt: Drafting())


def build(ctx: DecoderContext, method: str) -> Method:
    return declare(ctx.runtime)
