"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; Arctic Inference's vLLM plugin): drafts
from suffix trees (``infer/suffix_tree.py``) — one over this request's prompt and response,
one over the responses decoded earlier in this launch — whichever scores higher, its size
adapting to how long the match is and how often its continuations occurred.

Both trees grow token by token as the response is committed (the global one too, as Arctic
Inference does). The global tree starts empty in each launch (``reset`` after warm-up) and
a request never matches an earlier decode of itself: that response is removed first. No
trained drafter; lossless at temperature 0 and exact under sampling (the draft depends
only on committed tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from infer.candidates import Candidates
from infer.decoders.eagle3 import decode_tree
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.node_budget import NodeBudget
from infer.suffix_tree import SuffixTree
from schemafill.config import SuffixConfig
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.toolcall import ToolRequest


class RequestDrafter:
    """One request's drafter: its own prompt tree, and the launch's response tree."""

    def __init__(self, cfg: SuffixConfig, responses: SuffixTree | None, key: str, prompt_len: int) -> None:
        self.cfg, self.responses, self.key, self.prompt_len = cfg, responses, key, prompt_len
        self.local = SuffixTree(cfg.max_tree_depth)
        self.seen = 0  # tokens of prompt + response already in the trees

    def start(self, capacity: int) -> None:
        pass

    def catch_up(self, tokens: list[int]) -> None:
        """Add the tokens committed since the last call to both trees."""
        self.local.extend(0, tokens[self.seen:])
        if self.responses is not None:
            self.responses.extend(self.key, tokens[max(self.seen, self.prompt_len):])
        self.seen = len(tokens)

    def candidates(self, tokens: list[int], new_aux: torch.Tensor) -> Candidates:
        c = self.cfg
        self.catch_up(tokens)
        context = tokens[-c.max_tree_depth:]
        args = (c.num_speculative_tokens, c.max_spec_factor, c.max_spec_offset, c.min_token_prob, c.tree)
        best = self.local.speculate(context, *args)
        if self.responses is not None:
            other = self.responses.speculate(context, *args)
            if other.score > best.score:  # the prompt's tree wins ties
                best = other
        return Candidates.tree(best.tokens, best.parents, "suffix")


class SuffixDecoding:
    def __init__(self, target: Target, tokenizer: Any, eos: frozenset[int], max_new_tokens: int,
                 cfg: SuffixConfig, budget: NodeBudget | None = None, fmt: ResponseFormat = JSON) -> None:
        self.target, self.tokenizer, self.eos, self.max_new_tokens, self.cfg = target, tokenizer, eos, max_new_tokens, cfg
        self.fmt = fmt
        self.budget = budget or NodeBudget()
        self.reset()

    def reset(self) -> None:
        """Forget every earlier response (a launch's measured pass starts here)."""
        self.responses = SuffixTree(self.cfg.max_tree_depth) if self.cfg.max_cached_requests else None

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        if self.responses is not None:
            self.responses.remove(request.id)  # decoded before (warm-up, samples): never match itself
            while len(self.responses) >= self.cfg.max_cached_requests:  # room for this one: the oldest go
                self.responses.remove(next(iter(self.responses.sequences)))
        drafter = RequestDrafter(self.cfg, self.responses, request.id, len(prompt))
        decoded = decode_tree(self.target, self.tokenizer, prompt, options.cap(self.max_new_tokens), self.eos, drafter,
                              scratch=self.cfg.num_speculative_tokens, sampler=options.sampler,
                              constraint=options.constraint, budget=self.budget, on_commit=options.on_commit,
                              fmt=self.fmt)
        drafter.catch_up(list(prompt) + decoded.ids)  # the last verification's tokens too: later requests read them
        return decoded


def build(ctx: DecoderContext, method: str) -> SuffixDecoding:
    return SuffixDecoding(ctx.target, ctx.tokenizer, ctx.eos, ctx.decode.max_new_tokens, ctx.decode.suffix,
                          ctx.budget(), ctx.fmt)
