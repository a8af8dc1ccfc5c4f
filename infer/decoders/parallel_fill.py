"""Parallel Fill: the skeleton-then-fill baseline (paper §5, after Skeleton-of-Thought;
docs/design.md, "Parallel Fill").

Given AR's response as the skeleton, every argument value is generated independently by
the target — all of a request's values in one continuously batched stream — under the
same private context a SchemaFill SIDE branch uses (prompt, ordinal hint, the call's
canonical header up to the field's colon), and the response is rebuilt by putting each
generated literal where AR's stood. It is *not* lossless: a value generated without the
fields and calls before it can differ from AR's, which its AR agreement measures. Its
throughput counts filling and reconstruction only (the skeleton is supplied), and it has
no acceptance length. A response without argument values still costs the prompt's
prefill (the target must read the request), and nothing more.
"""

from __future__ import annotations

from typing import Any, Mapping

from infer.decoders.context import DecoderContext
from infer.rounds.decoding import Decoded, DecodeOptions
from infer.rounds.session import MainSession
from infer.slots.side import ordinal_hint
from schemafill.contract.parser import parse_prefix, response_layout
from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.stopping import ResponseStop
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.generation import generate
from schemafill.runtime.model import Target


class ValueStop(ResponseStop):
    """Stopping rule for one value: its literal closed, EOS, a parse error, or the cap."""

    def __init__(self, tokenizer: Any, eos: frozenset[int], header: str, key: str, max_tokens: int,
                 fmt: ResponseFormat = JSON) -> None:
        super().__init__(tokenizer, eos, max_tokens, fmt=fmt)
        self.header, self.key = header, key
        self.literal: str | None = None  # reason: closed | eos | error | length

    def _check(self) -> None:
        text = self.header + self.text
        if text.endswith("\ufffd"):  # a multi-byte character is still split
            return
        state = parse_prefix(text, self.fmt)
        self.literal = next((text[a:e] for k, a, e in state.spans if k == self.key), None)
        if self.literal is not None:
            self.reason = "closed"
        elif state.error is not None:
            self.reason = "error"


def build(ctx: DecoderContext, method: str) -> "ParallelFill":
    return ParallelFill(ctx.target, ctx.tokenizer, ctx.eos, skeletons=ctx.skeletons, fmt=ctx.fmt)


class ParallelFill:
    """``skeletons`` maps a request id to AR's output for it (``text``, ``output_ids``), filled
    by the time the request is decoded (``infer/run.py`` runs AR first)."""

    def __init__(self, target: Target, tokenizer: Any, eos: frozenset[int], max_value_tokens: int = 48,
                 batch_size: int = 32, skeletons: Mapping[str, dict] | None = None, fmt: ResponseFormat = JSON) -> None:
        self.target, self.tokenizer, self.eos, self.fmt = target, tokenizer, eos, fmt
        self.max_value_tokens, self.batch_size = max_value_tokens, batch_size
        self.skeletons = skeletons if skeletons is not None else {}

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        """AR's response to ``request``, filled value by value (greedy; ``options`` unused)."""
        if request.id not in self.skeletons:
            raise KeyError(f"parallel_fill has no AR skeleton for request {request.id!r}: decode it with ar first")
        skeleton = self.skeletons[request.id]
        return self.fill(prompt, skeleton["text"], skeleton["output_ids"], request.response_format(self.fmt))

    def fill(self, prompt: list[int], skeleton_text: str, skeleton_ids: list[int],
             fmt: ResponseFormat | None = None) -> Decoded:
        """Fill AR's response (``skeleton_text``, tokens ``skeleton_ids``, written in ``fmt``:
        the launch's by default) value by value."""
        tok, fmt = self.tokenizer, fmt or self.fmt
        slots = [(j, call.name, key, a, e) for j, call in enumerate(response_layout(skeleton_text, fmt))
                 if call.name is not None for key, a, e in call.spans]
        headers = [fmt.field_prefix(name, key) for _, name, key, _, _ in slots]
        stops = [ValueStop(tok, self.eos, h, key, self.max_value_tokens, fmt)
                 for h, (_, _, key, _, _) in zip(headers, slots)]
        prompts = [prompt + tok(ordinal_hint(j) + h, add_special_tokens=False).input_ids
                   for h, (j, _, _, _, _) in zip(headers, slots)]
        if prompts:  # the first admission prefills the prompt; the rest reuse it
            generate(self.target, tok, prompts, self.max_value_tokens, self.batch_size, self.eos,
                     make_stop=lambda i: stops[i])
        else:
            MainSession(self.target, prompt, ResponseStop(tok, self.eos, 1, fmt=fmt), scratch=0).prefill()

        text = skeleton_text
        for (_, _, _, a, e), stop in sorted(zip(slots, stops), key=lambda x: -x[0][3]):
            text = text[:a] + (stop.literal if stop.literal is not None else stop.text) + text[e:]
        ids = list(skeleton_ids) if text == skeleton_text else tok(text, add_special_tokens=False).input_ids
        return Decoded(ids=ids, text=text, stop="closed" if parse_prefix(text, fmt).closed else "rebuilt",
                       target_calls=0)
