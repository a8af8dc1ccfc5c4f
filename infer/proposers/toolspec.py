"""ToolSpec's drafting (method ``toolspec``) as its authors built it (hemingkx/ToolSpec,
``evaluation/inference_toolspec.py``), adapted only where our response format forces it.

Each step drafts from one source, in the authors' order:

* **step 0** (the prefill's tree): the response prefix plus every catalog tool's name,
  uncapped (``{"tool_calls": [{"name": "<tool>``);
* **step 1**: for the tool the response now ends with, one chain per parameter up to its
  value (``", "arguments": {"<key>": ``), or the bare arguments opener if none is detected;
* **later steps**, first that applies: (1) *retrieval*: n-grams of 7 down to 5 tokens ending
  the context, matched earliest first in the outputs of the 10 most similar earlier requests
  (cosine of the target's final hidden state at the prompt's end) followed by the prompt and
  response so far; up to 4 continuations of 32/16/8/8 tokens, each complete and none a prefix
  of another (≤ 64 nodes); (2) *schema*: when a field separator ends the last 4 tokens, the
  detected tool's keys that complete what follows it; (3) *token recycling*
  (``infer/token_recycling.py``): the 80-node template read from a table of each token's
  top-8 next tokens, which every verified node writes from the target's logits and which
  lives for the launch.

What differs from their code, and why: the target's response format (json, hermes'
``<tool_call>``, ...) replaces their four prefixes (``{"name": ``, ``<tool_call>``, ...) and
``"parameters"``. Their prefixes all put a call's name first; where the format writes it
after the arguments (``hermes3``: ``{"arguments": {...}, "name": "t"}``) the name cannot be
drafted first, so step 0 drafts the response prefix plus every tool's step-1 chains instead
(``{"arguments": {"<key>": `` for each of its keys, merged; a tool without keys: its
name after ``{}``), step 1 offers those chains again where the response still follows
one (else it takes the later steps' rules), the tool is detected from the keys the
current call has written once they fit exactly one tool (or from its name once written),
the separator rule completes the keys of the tools that still fit until then, and after
the arguments' ``}, `` it completes ``"name": "<tool>"}`` instead of a key. Names are
tokenized in context rather than alone; a key's chain stops at ``": `` (our values are typed JSON, theirs strings);
the retrieval key is the final state at the prompt's last token (their prefill stops one
token earlier); retrieved chains share prefixes in one tree (same acceptance, fewer nodes);
their self-match guard mixes two index spaces and drops valid matches, ours only requires a
complete continuation; and where the separator rule finds no key, their tree is a dummy
token-0 node, ours falls through to recycling. The recycling table and the memory start
empty in each launch (``reset`` after warm-up) and learn only from this launch's outputs.
Lossless at temperature 0; exact under sampling (drafts depend only on committed tokens;
the authors decode greedily only).
"""

from __future__ import annotations

from typing import Any

from infer.proposers.lookup import first_matches
from infer.proposers.retrieval import RetrievalStore
from infer.proposers.token_recycling import RecyclingTable, template_tree
from infer.rounds.candidates import Candidates
from infer.rounds.loop import Drafting, Pricing, Proposal
from infer.rounds.session import MainSession, Verified
from infer.rounds.tree import chain, merge
from schemafill.config import ToolSpecConfig
from schemafill.contract.parser import parse_prefix
from schemafill.contract.response_format import FIELD_BRIDGE, JSON, ResponseFormat, continuation_ids, dumps
from schemafill.contract.toolcall import ToolRequest

ARGUMENTS = '", "arguments": {'  # name-first formats: after a tool's name, up to its first key
NAME = '"name": '  # name-last formats: the key after the arguments


class SchemaFSM:
    """ToolSpec's schema drafts for one request: texts the response may continue along."""

    def __init__(self, request: ToolRequest, fmt: ResponseFormat = JSON) -> None:
        self.fmt = fmt
        self.tools = {fn["name"]: list((fn.get("parameters") or {}).get("properties") or {})
                      for fn in request.slot_functions}
        # detected once the response ends with a tool's name (a structured output's is known)
        self.tool: str | None = fmt.bare
        # name-last formats, until a tool is detected: the tools whose schema holds every key
        # the current call has written (name-first formats: never any)
        self.fits: list[str] = []

    def names(self) -> list[str]:
        """Step 0: the response prefix and each tool's name (name-last formats: each tool's
        ``{"arguments": {"<key>": `` chains, or its name after empty arguments)."""
        if self.fmt.name_first:
            return [self.fmt.header + '{"name": "' + name for name in self.tools]
        texts = []
        for name, keys in self.tools.items():
            opener = self.fmt.header + self.fmt.call_header(name)  # ``{"arguments": {``
            texts += [opener + dumps(k) + ": " for k in keys] or [opener + "}" + FIELD_BRIDGE + NAME + '"' + name]
        return list(dict.fromkeys(texts))

    def detect(self, text: str) -> None:
        if self.tool is not None:
            return
        if self.fmt.name_first:
            self.tool = next((t for t in self.tools if text.endswith('"name": "' + t)), None)
            return
        # name-last: the name once written, else the keys written so far in the current call
        state = parse_prefix(text, self.fmt)
        if state.tool_name in self.tools:
            self.tool, self.fits = state.tool_name, [state.tool_name]
            return
        written = {k for k, _, _ in state.spans} | ({state.field} if state.field is not None else set())
        self.fits = [t for t, keys in self.tools.items() if written <= set(keys)]
        if written and len(self.fits) == 1:
            self.tool = self.fits[0]

    def first_keys(self, text: str) -> list[str]:
        if not self.fmt.name_first:  # step 1: the step-0 chains, where the response still follows one
            return self.names()
        keys = self.tools.get(self.tool) or []
        if not keys:
            return [text + ARGUMENTS + '"']
        return [text + ARGUMENTS + dumps(k) + ": " for k in keys]

    def next_keys(self, text: str, tail: str, in_arguments: bool = True) -> list[str]:
        """Keys of the detected tool completing what follows a separator in ``tail`` (the last
        tokens' text); [] when none is there. Name-last formats: before a tool is detected,
        the keys of the tools that fit; after the arguments (``in_arguments`` False), the
        ``"name": "<tool>"}`` that ends the call."""
        at = tail.rfind(FIELD_BRIDGE)
        tools = [self.tool] if self.tool is not None else self.fits
        if at < 0 or not tools:
            return []
        typed = tail[at + len(FIELD_BRIDGE):]
        if in_arguments or self.fmt.name_first:
            pieces = [dumps(k) + ": " for t in tools for k in self.tools[t]]
        else:
            pieces = [NAME + dumps(t) + "}" for t in tools]
        return [text + piece[len(typed):] for piece in dict.fromkeys(pieces) if piece.startswith(typed)]


def retrieval_candidates(tokens: list[int], retrieved: list[int], cfg: ToolSpecConfig) -> list[list[int]]:
    """Continuations of the context's trailing n-gram in the retrieved outputs, then in the
    context itself: one per slot length, complete, none a prefix of another."""
    source = retrieved + tokens
    found: list[list[int]] = []
    for start in first_matches(tokens, source, cfg.ngram_min, cfg.ngram_max):
        if len(found) == len(cfg.candidates):
            break
        c = source[start:start + cfg.candidates[len(found)]]
        if len(c) < cfg.candidates[len(found)]:
            continue
        if any(c[:len(f)] == f or f[:len(c)] == c for f in found):
            continue
        found.append(c)
    return found




class ToolSpecMemory:
    """What ToolSpec keeps across a launch's requests: the recycling table (each token's
    top-k next tokens, written by every verified node) and the retrieval store of earlier
    outputs. Both start empty in each launch (``reset`` after warm-up)."""

    def __init__(self, cfg: ToolSpecConfig, vocab_size: int, device: Any) -> None:
        self.cfg, self.vocab_size, self.device = cfg, vocab_size, device
        self.template = template_tree()
        if cfg.recycling_topk <= max(self.template[1]):
            raise ValueError(f"decode.toolspec.recycling_topk={cfg.recycling_topk}: the 80-node template reads "
                             f"columns up to {max(self.template[1])}, so it needs at least {max(self.template[1]) + 1}")
        self.reset()

    def reset(self) -> None:
        self.table = RecyclingTable(self.vocab_size, self.cfg.recycling_topk, self.device)
        self.store = RetrievalStore(self.cfg.retrieve)


class ToolSpecDrafting(Drafting):
    """One request's ToolSpec steps (the module docstring): step 0 with the prefill, step 1,
    then retrieval, the schema's keys or token recycling, first that applies."""

    def __init__(self, memory: ToolSpecMemory, request: ToolRequest, tokenizer: Any, fmt: ResponseFormat,
                 pricing: Pricing | None = None) -> None:
        super().__init__(pricing)
        self.memory, self.request, self.tokenizer, self.fmt = memory, request, tokenizer, fmt
        self.fsm = SchemaFSM(request, fmt)
        self.names = self._along([], "", self.fsm.names())
        self.scratch = max(len(memory.template[0]), sum(memory.cfg.candidates), len(self.names[0]),
                           self._keys_bound())
        self.step = 0
        self.retrieved: list[int] = []

    def first(self, s: MainSession) -> Proposal:
        return Proposal(Candidates.tree(*self.names, "fsm"))

    def settle(self, s: MainSession, p: Proposal, v: Verified) -> None:
        if v.main_logits is not None and v.main_tokens:
            self.memory.table.update(v.main_tokens, v.main_logits)
        if not self.step:  # the prefill: the retrieval key exists now
            self.retrieved = [t for out in self.memory.store.nearest(s.prompt_final, exclude=self.request.id)
                              for t in out]
        self.step += 1

    def finish(self, s: MainSession) -> dict:
        self.memory.store.add(self.request.id, s.prompt_final, s.response)
        return {}

    def draft(self, s: MainSession) -> Proposal:
        fsm = self.fsm
        # as theirs, the name is looked for before the root (the pending token, their bonus
        # token); once found, the text is no longer decoded every step
        before_root = (self.tokenizer.decode(s.response[:-1], skip_special_tokens=True)
                       if fsm.tool is None or self.step == 1 else "")
        fsm.detect(before_root)
        text, committed = s.stop.parsed_text, s.response
        if self.step == 1:  # the chains start before the root: the ones the root continues are kept
            first = self._along(committed, text, fsm.first_keys(before_root))
            if first[0] or self.fmt.name_first:  # name-last formats: else the later steps' rules
                return Proposal(Candidates.tree(*first, "fsm"))
        found = retrieval_candidates(s.tokens, self.retrieved, self.memory.cfg)
        if found:
            return Proposal(Candidates.tree(*merge([chain(c) for c in found]), "retrieval"))
        tail = self.tokenizer.decode(committed[-4:], skip_special_tokens=True)
        state = s.stop.parser.state
        keys = self._along(committed, text, fsm.next_keys(text, tail, state.field is not None or state.in_key))
        if keys[0]:
            return Proposal(Candidates.tree(*keys, "fsm"))
        parents, columns = self.memory.template
        # a template node's column (its rank among its parent's recycled successors) is its source
        return Proposal(Candidates(self.memory.table.draft(s.tokens[-1], parents, columns), list(parents),
                                   [f"recycle:{c}" for c in columns]))

    def _along(self, committed: list[int], text: str, targets: list[str]) -> tuple[list, list]:
        """One merged tree of the continuations of ``text`` toward each target text."""
        chains = [continuation_ids(self.tokenizer, committed, text, t[len(text):], self.fmt) for t in targets
                  if t.startswith(text)]
        return merge([chain(c) for c in chains if c]) if chains else ([], [])

    def _keys_bound(self) -> int:
        """Most nodes a key step may draft (its chains, unmerged, a token of slack each for
        merges across the boundary)."""
        fsm = self.fsm

        def size(texts: list[str]) -> int:
            return sum(len(self.tokenizer(t, add_special_tokens=False).input_ids) + 1 for t in texts)
        if not self.fmt.name_first:  # step 1's are step 0's; then the keys or names of every tool that may fit
            keys = dict.fromkeys(FIELD_BRIDGE + dumps(k) + ": " for keys in fsm.tools.values() for k in keys)
            names = [FIELD_BRIDGE + NAME + dumps(t) + "}" for t in fsm.tools]
            return max(size(fsm.names()), size(list(keys) + names))
        return max([size([ARGUMENTS + dumps(k) + ": " for k in keys]) for keys in fsm.tools.values()] + [0])
