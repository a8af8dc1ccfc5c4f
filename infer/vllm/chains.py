"""SchemaFill's chain drafting for a request known only by its token ids: what an engine's
proposer can draft each step (vLLM's ``custom_class``, ``infer/vllm/proposer.py``), with no
request object, no tree and no SIDE branch.

From the prompt's tokens (cached per prompt): the tool catalog rendered there (JSON schemas,
ours one per line or a chat template's ``{"type": "function", ...}`` objects), the response
format the prompt asks for, and SchemaFill's forecast — BM25 over the catalog against the
conversation after it, cycled into call plans. From the response so far, each step: the parse
of its text (``Reading``, a function of the tokens alone: advanced by a step's new tokens when
they extend the tokens it read, read afresh when they do not, so requests joining, leaving or
moving in the engine's batch cannot put a stale state on another, and a step costs its new
tokens rather than the whole response), then the packer's chain after the committed text —
wrappers, tool names, argument keys, separators and closings, realized calls rebinding their
plans — up to the first value; inside a value, the rest of the conversation's word it started
(matched as text), closed there and followed by the structure after it; when neither applies,
or the response has gone off its format (a small target looping inside a string), a copy of
what followed the same tokens in the prompt or earlier in the response, whichever agrees
longer. One chain of at most ``k`` tokens: the engine verifies chains, and its rejection
sampler decides every token.

Where the response starts: after the last generation marker in the tokens — the chat
template's generation prompt, or the plain prompt's ``Response:`` line. No marker, no catalog
or a response that is not a tool call: an empty draft.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from infer.proposers.lookup import copy_matches
from infer.slots.align import current_call, rebind
from infer.slots.forecast import call_plan, forecast_groups, rank_tools
from infer.slots.packer import CallPlan, propose_tagged
from infer.slots.policy import copy_source
from schemafill.contract.parser import CallLayout, ParseState, ToolCallParser
from schemafill.contract.prompt import INSTRUCTIONS, format_instructions
from schemafill.contract.response_format import FORMATS, HERMES, JSON, ResponseFormat, stable_continuation_ids
from schemafill.contract.toolcall import ToolRequest

STRUCTURE, VALUE = "structure", "value"  # what a chain is, or a copy's source (acceptance is learnt per kind)
PLAIN_MARKER = "\n\nResponse:\n"  # how a plain prompt hands over (``schemafill.contract.prompt.render_plain``)
SCHEMA_START = re.compile(r'\{\s*"(?:name|type)"\s*:')
WORD_REST = re.compile(r'[^\s"\\,.;:!?()\[\]{}]*')  # where a copied word goes on


@dataclass
class Reading:
    """What a request's tokens say so far: where its response starts (one past the last
    generation marker; None: no marker), the prompt before it, and the response's text with
    the parser fed that text (None where no parse is wanted: no catalog, not a tool call).
    ``ChainDrafter.read`` advances it with the tokens of a later step."""

    tokens: list[int]
    start: int | None
    prompt: "Prompt | None" = None
    key: tuple[int, ...] | None = None  # the prompt's tokens, which name the request
    text: str = ""
    parser: ToolCallParser | None = None

    @property
    def response(self) -> list[int]:
        return [] if self.start is None else self.tokens[self.start:]

    def extended_by(self, tokens: list[int]) -> bool:
        """Do ``tokens`` begin with the tokens this reading read (a later step of its request)?"""
        return len(self.tokens) <= len(tokens) and tokens[:len(self.tokens)] == self.tokens


@dataclass
class Prompt:
    """What a prompt's tokens say once: its catalog, the format it asks for, the forecast."""

    functions: dict[str, dict]
    fmt: ResponseFormat
    groups: list[str]  # the forecast's tool per call group
    query: str  # the conversation after the catalog (values are copied from it)

    def plans(self) -> list[CallPlan]:
        return [call_plan(self.functions[t]) for t in self.groups]


def catalog(text: str) -> tuple[list[dict], list[tuple[int, int]]]:
    """The function schemas rendered in ``text`` (``{name, parameters, ...}`` objects, or the
    ``{"type": "function", "function": {...}}`` a chat template writes), and where each is."""
    decoder, found, spans, i = json.JSONDecoder(), [], [], 0
    while (m := SCHEMA_START.search(text, i)) is not None:
        try:
            obj, end = decoder.raw_decode(text, m.start())
        except ValueError:
            i = m.start() + 1
            continue
        fn = obj.get("function") if obj.get("type") == "function" else obj
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters"), dict):
            found.append(fn)
            spans.append((m.start(), end))
            i = end
        else:
            i = m.start() + 1
    return found, spans


def asked_format(text: str) -> ResponseFormat:
    """The response format the prompt shows (its template text), else hermes where it mentions
    ``<tool_call>`` blocks, else json."""
    for fmt in FORMATS.values():
        if fmt.template in text:
            return fmt
    return HERMES if "<tool_call>" in text else JSON


class ChainDrafter:
    """``draft(tokens, k)``: the chain after a request's tokens (module docstring)."""

    def __init__(self, tokenizer: Any, fmt: ResponseFormat | None = None, forecast_budget: int = 3,
                 copy_len: int = 8, cache: int = 256) -> None:
        self.tokenizer, self.fmt, self.budget, self.copy_len = tokenizer, fmt, forecast_budget, copy_len
        self.markers = generation_markers(tokenizer)
        self.prompts: OrderedDict[tuple[int, ...], Prompt | None] = OrderedDict()
        self.cache = cache

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return self.draft_tagged(tokens, k)[0]

    def draft_tagged(self, tokens: list[int], k: int, reading: Reading | None = None) -> tuple[list[int], str]:
        """``draft``, and what the chain is: ``structure`` (the packer's, up to the first
        value), ``value`` (a copied value, closed, and the structure after it), ``copy`` (a
        token copy); acceptance is learnt per kind (``proposer.py``). ``reading``: the
        tokens' ``read``, when the caller holds it."""
        reading = self.read(tokens) if reading is None else reading
        if reading.parser is None or k < 1:
            return [], ""
        prompt, text, parser = reading.prompt, reading.text, reading.parser
        state = parser.state
        if state.closed:
            return [], ""
        chain, kind = [], ""
        if state.error is None and state.in_value:
            copied = self.value_copy(prompt, text, state)
            if copied:
                chain, kind = self.structure(prompt, text, state, parser.layout, reading.response, copied), VALUE
        elif state.error is None:
            chain, kind = self.structure(prompt, text, state, parser.layout, reading.response), STRUCTURE
        if not chain and self.copy_len:
            # a value the conversation does not hold, or a response gone off its format (a small
            # target looping inside a string): what followed the same tokens before
            chain, kind = self.copy(tokens, reading.start, min(k, self.copy_len), state.in_value)
        return chain[:k], kind if chain else ""

    def read(self, tokens: list[int], held: Reading | None = None) -> Reading:
        """The ``Reading`` of ``tokens``; from ``held`` (an earlier step's) where ``tokens``
        extend the tokens it read, so that only the new ones are scanned, decoded into the
        parse and fed to it. Equal to a fresh read either way."""
        if held is None or not held.extended_by(tokens):
            return self._parse(Reading(tokens, self.response_start(tokens)))
        start = self.response_start(tokens, after=len(held.tokens), best=held.start)
        if start != held.start:  # a new generation marker: a new response
            return self._parse(Reading(tokens, start))
        return self._parse(Reading(tokens, start, held.prompt, held.key, held.text, held.parser), known=True)

    def _parse(self, reading: Reading, known: bool = False) -> Reading:
        """Fill in ``reading``'s prompt (unless ``known``), text and parser: the parser goes on
        from the text it has seen where the new text extends it (detokenisation may revise a
        split character's bytes: then it parses afresh)."""
        if reading.start is None:
            return reading
        if not known:
            reading.key = tuple(reading.tokens[:reading.start])
            reading.prompt = self.prompt(reading.key)
        if reading.prompt is None:
            reading.parser = None
            return reading
        fmt = reading.prompt.fmt
        text = fmt.decode(self.tokenizer, reading.response)
        if not (text.startswith(fmt.marker) or fmt.marker.startswith(text)):
            reading.text, reading.parser = text, None  # not a tool-call response
            return reading
        if reading.parser is None or not text.startswith(reading.text):
            reading.parser, reading.text = ToolCallParser(fmt), ""
        reading.parser.feed(text[len(reading.text):])
        reading.text = text
        return reading

    @staticmethod
    def copy(tokens: list[int], start: int, n: int, in_value: bool) -> tuple[list[int], str]:
        """The copy whose source agrees longest with the text before it, from the prompt or
        the response so far (on a tie the response: a response repeats itself), tagged by
        where from and how long the agreement is (``copy_source``)."""
        best: tuple[int, list[int], str] | None = None
        for source, where, own in ((tokens[start:], "copy_response", True),
                                   (tokens[:start], "copy_value" if in_value else "copy_prompt", False)):
            for copied, matched in copy_matches(tokens, source, length=n, overlap=own, most=1):
                if best is None or matched > best[0]:
                    best = (matched, copied, copy_source(where, matched))
        return ([], "") if best is None else (best[1], best[2])

    def structure(self, prompt: Prompt, text: str, state: ParseState, layout: tuple[CallLayout, ...],
                  response: list[int], value: str | None = None) -> list[int]:
        """The packer's chain after ``text``, its plans rebound to the tools the response named;
        given the ``value`` being written (its literal so far and a guess at the rest), through
        its guessed end and on with the structure after it."""
        plans = prompt.plans()
        for j, call in enumerate(layout):  # every call opened, the current one with its name once written
            if call.name is not None:
                rebind(plans, j, call.name, prompt.functions)
        provisional = None if value is None else {(current_call(state), state.field): value}
        suffix, _, then, _ = propose_tagged(text, state, plans, provisional=provisional, fmt=prompt.fmt,
                                         close=value is not None)
        return stable_continuation_ids(self.tokenizer, response, text, suffix, then, prompt.fmt)

    @staticmethod
    def value_copy(prompt: Prompt, text: str, state: ParseState) -> str | None:
        """The open value's literal with the rest of the word the conversation has it in (values
        are mostly copied from the request): matched as text, since a value's first token
        rarely equals the word's token in running text. None when the conversation has no such
        word, or the value has no text yet."""
        literal = text[state.value_start:]
        written = literal[1:] if literal.startswith('"') else literal
        if not written:
            return None
        at = prompt.query.rfind(written)
        while at > 0 and prompt.query[at - 1].isalnum():  # from a word's start only
            at = prompt.query.rfind(written, 0, at)
        if at < 0:
            return None
        rest = WORD_REST.match(prompt.query, at + len(written)).group()
        return literal + rest if rest else None

    def response_start(self, tokens: list[int], after: int = 0, best: int | None = None) -> int | None:
        """One past the last generation marker in ``tokens`` (None: no marker); ``after``,
        ``best``: the first ``after`` tokens were scanned already and gave ``best``, so only
        markers that end past them are looked for."""
        for marker in self.markers:
            n = len(marker)
            for i in range(len(tokens) - n, max(after - n, -1), -1):
                if tokens[i:i + n] == marker:
                    best = max(best or 0, i + n)
                    break
        return best

    def prompt(self, ids: list[int] | tuple[int, ...]) -> Prompt | None:
        """The prompt's catalog, format and forecast (None: no catalog), cached per prompt."""
        key = tuple(ids)
        if key in self.prompts:
            self.prompts.move_to_end(key)
            return self.prompts[key]
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        functions, spans = catalog(text)
        found = None
        if functions:
            fmt = self.fmt or asked_format(text)
            # the query is the conversation: what follows the catalog, less our own instructions
            query = text[spans[-1][1]:].replace(format_instructions(fmt), " ").replace(INSTRUCTIONS, " ")
            request = ToolRequest(id="", messages=[{"role": "user", "content": query}],
                                  tools=[{"type": "function", "function": fn} for fn in functions])
            groups = forecast_groups(rank_tools(request), self.budget)
            found = Prompt({fn["name"]: fn for fn in functions}, fmt, [functions[g]["name"] for g in groups], query)
        self.prompts[key] = found
        if len(self.prompts) > self.cache:
            self.prompts.popitem(last=False)
        return found


def generation_markers(tokenizer: Any) -> list[list[int]]:
    """Token sequences a prompt ends with where the response starts: the plain prompt's
    ``Response:`` line and, with a chat template, its generation prompt (as tokenised after a
    turn, where merges across the boundary would show)."""
    markers = []
    head = tokenizer("x", add_special_tokens=False).input_ids
    plain = tokenizer("x" + PLAIN_MARKER, add_special_tokens=False).input_ids
    if plain[:len(head)] == head:
        markers.append(plain[len(head):])
    if getattr(tokenizer, "chat_template", None):
        turn = [{"role": "user", "content": "x"}]
        try:
            closed = tokenizer.apply_chat_template(turn, tokenize=False)
            opened = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render a lone user turn has no marker
            opened = closed = ""
        if opened.startswith(closed) and len(opened) > len(closed):
            a = tokenizer(closed, add_special_tokens=False).input_ids
            b = tokenizer(opened, add_special_tokens=False).input_ids
            if b[:len(a)] == a:
                markers.append(b[len(a):])
    return [m for m in markers if m]
