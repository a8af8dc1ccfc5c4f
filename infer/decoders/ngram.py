"""Prompt-lookup (n-gram) decoding, as vLLM's ``ngram`` speculative method: the draft is
the tokens that followed the earliest earlier occurrence of the context's longest trailing
n-gram (``infer/lookup.ngram_lookup``), searched in the prompt and the response so far; no
trained drafter. Lossless at temperature 0, and exact under sampling (the draft depends only
on committed tokens; ``infer/sampling.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from infer.candidates import Candidates
from infer.decoders.eagle3 import decode_tree
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.lookup import ngram_lookup
from infer.node_budget import NodeBudget
from schemafill.config import NgramConfig
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.toolcall import ToolRequest


@dataclass(frozen=True)
class NgramDrafter:
    cfg: NgramConfig

    def start(self, capacity: int) -> None:
        pass

    def candidates(self, tokens: list[int], new_aux: torch.Tensor) -> Candidates:
        c = self.cfg
        return Candidates.chain(ngram_lookup(tokens, c.prompt_lookup_min, c.prompt_lookup_max,
                                             c.num_speculative_tokens), "ngram")


@dataclass(frozen=True)
class Ngram:
    target: Target
    tokenizer: Any
    eos: frozenset[int]
    max_new_tokens: int
    cfg: NgramConfig
    budget: NodeBudget = field(default_factory=NodeBudget)
    fmt: ResponseFormat = JSON

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        return decode_tree(self.target, self.tokenizer, prompt, options.cap(self.max_new_tokens), self.eos,
                           NgramDrafter(self.cfg), scratch=self.cfg.num_speculative_tokens, sampler=options.sampler,
                           constraint=options.constraint, budget=self.budget, on_commit=options.on_commit,
                           fmt=self.fmt)


def build(ctx: DecoderContext, method: str) -> Ngram:
    return Ngram(ctx.target, ctx.tokenizer, ctx.eos, ctx.decode.max_new_tokens, ctx.decode.ngram, ctx.budget(), ctx.fmt)
