"""ToolSpec-lite (method ``toolspec_lite``; issue #10): a stronger schema FSM than ToolSpec's,
small retrieval, one verified tree of at most 16 nodes. ``toolspec`` is the authors' method
(``infer/decoders/toolspec.py``); this variant is what we built from the paper before
reading their code, kept as a point between ToolSpec and SchemaFill:

* **Schema state machine.** From MAIN's parse state the response grammar predicts the
  structural text it can: the header, a tool-name continuation for every catalog tool the
  typed prefix still allows, then ``", "arguments": {"`` and the chosen tool's keys in
  schema order (its required ones, or all when none is required; a partial key completes
  to any schema key) with their delimiters, up to the first value; after a call, both ``]}`` and
  ``, {"name": ...`` for each tool. In a format that writes the name after the arguments
  (``hermes3``) the same continuations run the other way: ``{"arguments": {"`` and each
  tool's keys first, the tools still allowed being those whose schema holds every key
  written so far, then ``}, "name": "<tool>"}``. (Built on the packer with one plan per tool and no
  prepared values: the same canonical serialization SchemaFill uses.)
* **Retrieval.** A summary of the request — the mean of the target's three fused hidden
  states over the prompt, from the prefill — is compared by cosine similarity with the
  requests decoded before (a store filled as requests finish; a request never retrieves
  its own output); the top 3 outputs are sources of candidate continuations.
* **One tree.** Candidates are merged into one prefix tree and verified by the target like
  EAGLE-3's; the longest greedy path plus the correction is committed, so it is lossless.

Where we had to decide: continuations are taken from a source by prompt-lookup copying
(``infer/lookup.py``) — the longest suffix (up to 3 tokens) of the committed text found in
the source proposes the tokens after its last occurrence — and the prompt and the response so far are sources too
(values are often copied from the request). Chains are added FSM first, then retrieved
ones in similarity order, until the tree holds ``total`` nodes; each is at most ``length``
tokens. No learned drafter is involved.
"""

from __future__ import annotations

from typing import Any

from infer.align import holds_keys, written_keys
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.forecast import call_plan
from infer.packer import CallPlan, continuation_ids, propose
from infer.phases import Phases
from infer.lookup import copy_after_suffix
from infer.retrieval import RetrievalStore
from infer.session import MainSession
from infer.tree import chain, merge
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.toolcall import ToolRequest


def build(ctx: DecoderContext, method: str) -> "ToolSpecLite":
    return ToolSpecLite(ctx.target, ctx.tokenizer, ctx.eos, ctx.decode.max_new_tokens, fmt=ctx.fmt)


class ToolSpecLite:
    def __init__(self, target: Target, tokenizer: Any, eos: frozenset[int], max_new_tokens: int,
                 total: int = 16, length: int = 12, k: int = 3, fmt: ResponseFormat = JSON) -> None:
        self.target, self.tokenizer, self.eos, self.max_new_tokens = target, tokenizer, eos, max_new_tokens
        self.fmt = fmt
        self.total, self.length = total, length
        self.k = k
        self.reset()

    def reset(self) -> None:
        """Forget earlier outputs (a launch's measured pass starts here)."""
        self.store = RetrievalStore(self.k)

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()) -> Decoded:
        phases = Phases("drafting", "verification")
        plans = {fn["name"]: call_plan(fn) for fn in request.functions}
        s = MainSession(self.target, prompt, options.response_stop(self.tokenizer, self.eos, self.max_new_tokens,
                                                                   self.fmt),
                        scratch=self.total, sampler=options.sampler, constraint=options.constraint)
        with phases("verification"):
            s.prefill()
        summary = s.new_aux[: len(prompt)].mean(0)  # [3H]
        sources = self.store.nearest(summary, exclude=request.id)
        while not s.done:
            with phases("drafting"):
                tokens, parents = self._tree(s, plans, sources + [prompt])
            with phases("verification"):
                s.verify(tokens, parents)
        self.store.add(request.id, summary, s.response)
        return s.decoded(times=phases.times)

    def _tree(self, s: MainSession, plans: dict[str, CallPlan], sources: list[list[int]]) -> tuple[list, list]:
        text, state = s.stop.parsed_text, s.stop.parser.state
        committed = s.response
        chains = []
        # the schema FSM: one canonical continuation per tool the committed text still allows
        position = state.call_index if state.call_index is not None else state.calls_started
        if state.tool_name in plans:
            realized = [plans[state.tool_name]]
        elif state.tool_name is None:  # the tools the keys written so far allow (name-first: none yet, all)
            keys, partial = written_keys(text, state)
            realized = [p for p in plans.values() if holds_keys(p.schema_keys, keys, partial)]
        else:
            realized = list(plans.values())
        for plan in realized:
            suffix = propose(text, state, [plan] * (position + 1), cross_calls=state.call_index is None, fmt=self.fmt)
            if suffix:
                chains.append(continuation_ids(self.tokenizer, committed, text, suffix.rstrip(" "), self.fmt))
        if state.call_index is None and state.calls_started:  # or the list closes here
            closing = propose(text, state, [], fmt=self.fmt)
            chains.append(continuation_ids(self.tokenizer, committed, text, closing, self.fmt))
        # retrieval and prompt lookup: earlier outputs, the prompt, the response so far
        context = s.tokens  # prompt + committed (the pending token last)
        for source in sources + [committed]:
            chains.append(copy_after_suffix(context, source, length=self.length))
        tree: tuple[list, list] = ([], [])
        for c in chains:
            if not c:
                continue
            grown = merge([tree, chain(c[: self.length])])
            if len(grown[0]) > self.total:
                continue
            tree = grown
        return tree
