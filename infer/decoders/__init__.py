"""The methods: each name, the module that builds its decoder, and the rules for combining them.

Adding a method is adding a proposer (``infer/proposers``) and a module here whose
``build(ctx, method)`` declares it: a ``Method`` over the one round loop, with the per-request
``Drafting`` that uses the proposer (``infer/rounds/loop.py``), and one line in ``FACTORIES``.
A method that learns across requests (``toolspec``'s table and memory, ``suffix``'s response
tree) has ``reset()``, which a launch calls after its warm-up requests.
"""

from __future__ import annotations

from typing import Callable

from infer.decoders import ar, eagle3, ngram, parallel_fill, slot_parallel, suffix, toolspec
from infer.decoders.context import DecoderContext
from infer.rounds.decoding import Decoder
from schemafill.config import ABLATIONS

FACTORIES: dict[str, Callable[[DecoderContext, str], Decoder]] = {
    "ar": ar.build,
    "eagle3": eagle3.build,
    "eagle3_wide": eagle3.build,
    "toolspec": toolspec.build,
    "ngram": ngram.build,
    "suffix": suffix.build,
    "schemafill": slot_parallel.build,
    **{f"schemafill_{a}": slot_parallel.build for a in ABLATIONS},  # its ablation stages
    "parallel_fill": parallel_fill.build,
}
METHODS = tuple(FACTORIES)
SKELETON_METHODS = ("parallel_fill",)  # fill AR's response: greedy only, and AR must run first


def ablation_method(stage: str) -> str:
    """The method name of SchemaFill's ablation ``stage`` (A–D)."""
    if stage not in ABLATIONS:
        raise ValueError(f"SchemaFill's stages are {ABLATIONS}, got {stage!r}")
    return f"schemafill_{stage}"


def check(methods: list[str], temperature: float) -> None:
    """A clear error for a list of methods that cannot run as given (before any model loads)."""
    unknown = [m for m in methods if m not in FACTORIES]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; the methods are {list(METHODS)}")
    for m in methods:
        if m not in SKELETON_METHODS:
            continue
        if "ar" not in methods or methods.index("ar") > methods.index(m):
            raise ValueError(f"{m} fills AR's skeleton: list ar before it in methods")
        if temperature > 0:
            raise ValueError(f"{m} is a greedy diagnostic: drop it when decode.temperature > 0")


def reset(decoder: Decoder) -> None:
    """Forget what ``decoder`` learnt from earlier requests, if it learns at all."""
    if hasattr(decoder, "reset"):
        decoder.reset()


def build(methods: list[str], ctx: DecoderContext) -> dict[str, Decoder]:
    """Method name → decoder, in the order asked for."""
    return {m: FACTORIES[m](ctx, m) for m in methods}
