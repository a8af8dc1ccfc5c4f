"""The response formats, in one place: how a tool-call response is written (docs/design.md, "Contracts").

Every format wraps the same call objects, ``{"name": "t", "arguments": {"k": v, ...}}``
(canonical JSON, ``", "`` and ``": "``), in its own text:

* ``json`` — the paper's and the built-in target's: one object holding the list of calls,
  ``{"tool_calls": [call, call]}``; the response ends with its closing brace.
* ``hermes`` — what Qwen2.5/Qwen3 write and vLLM's ``hermes`` parser reads: one
  ``<tool_call>\\ncall\\n</tool_call>`` block per call, one per line; EOS ends the response.
* ``hermes3`` — the same blocks with each call's ``"arguments"`` before its ``"name"``, the
  order Hermes-2-Pro's and Hermes-3's chat templates ask for.
* ``mistral`` — what Mistral-7B-Instruct-v0.3 writes and vLLM's ``mistral`` parser reads:
  ``[TOOL_CALLS] [call, call]``, the lead marker (a control token of Mistral's vocabulary)
  before one JSON list; the list's closing bracket ends the response.
* ``object`` — a structured output (``object_format``): one JSON object under a client's
  schema, with nothing around it, read as the arguments of one call of that schema.

A format is the header before the first call, the bridge between two calls, the closing
after the last, and what follows from them: the serializer, the context a SIDE branch (and
Parallel Fill) writes a value after, reading calls back out of a response, finished or not
(``call_spans``: the server's answers), and whether the text itself ends the response.
Everything that writes or predicts response text takes its pieces from a ``ResponseFormat``
(the parser, packer, stopping rule, prompts, SIDE, ToolSpec's FSM), so MAIN and SIDE texts
tokenize alike: they are the same strings. Pure: standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

KEY = "tool_calls"  # the json format's list key
# what `json.dumps` writes by default and what prompts show the target, so MAIN and SIDE
# texts tokenize the same way
SEPARATORS = (", ", ": ")
FIELD_BRIDGE = ", "  # between two arguments of a call
CALL_CLOSE = "}}"  # a call's arguments, then the call
CALL_EXAMPLE = '{"name": "<tool name>", "arguments": {"<argument>": <JSON value>, ...}}'


def dumps(value: Any) -> str:
    """Canonical JSON text of one value (unicode kept, the canonical separators)."""
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


NO_TOOL = "None of the available tools can do that."  # the reply in words of the tagged and lead formats
ARGS_FIRST_EXAMPLE = '{"arguments": {"<argument>": <JSON value>, ...}, "name": "<tool name>"}'


@dataclass(frozen=True)
class ResponseFormat:
    """How one family of targets writes its calls around the canonical call objects."""

    name: str
    header: str  # the response up to its first call's "{"
    call_bridge: str  # from a call's closing "}" to the next call's "{"
    close: str  # after the last call's "}"
    self_closing: bool  # the text after ``close`` ends the response; else the target's EOS does
    empty: str  # the reply when no tool fits
    template: str  # the format as prompts show it
    # tagged formats: the literal tags around each call (None: the calls sit in one JSON list)
    open_tag: str | None = None
    close_tag: str | None = None
    # list formats: the marker before the JSON list of calls (None: the json format's object)
    lead: str | None = None
    name_first: bool = True  # each call's "name" before its "arguments" (False: after them)
    # a structured output (``object_format``): the response is one JSON object and nothing
    # around it, read as the arguments of one call of the schema named here
    bare: str | None = None

    @property
    def marker(self) -> str:
        """The text a tool-call response starts with (``is_calls``)."""
        return self.open_tag or self.lead or self.header

    @property
    def in_words(self) -> bool:
        """A reply without calls is free text (tagged and lead formats), not an empty list."""
        return self.open_tag is not None or self.lead is not None

    def call_header(self, tool: str) -> str:
        """A call of ``tool`` up to its first argument's key (name-last formats: without it)."""
        if self.bare is not None:
            return "{"
        if self.name_first:
            return '{"name": ' + dumps(tool) + ', "arguments": {'
        return '{"arguments": {'

    def call_close(self, tool: str) -> str:
        """A call of ``tool`` from the end of its last argument's value to its closing brace."""
        if self.bare is not None:
            return "}"
        return CALL_CLOSE if self.name_first else '}, "name": ' + dumps(tool) + "}"

    def call_object(self, call: dict) -> dict:
        """``call`` (``{"name": ..., "arguments": {...}}``) with its keys in this format's order."""
        order = ("name", "arguments") if self.name_first else ("arguments", "name")
        return {k: call[k] for k in order if k in call} | {k: v for k, v in call.items() if k not in order}

    def serialize(self, calls: list[dict]) -> str:
        """The response text of ``calls`` (each ``{"name": ..., "arguments": {...}}``)."""
        if self.bare is not None:
            return dumps(calls[0]["arguments"]) if calls else self.empty
        if not calls and self.in_words:
            return self.empty
        return self.header + self.call_bridge.join(dumps(self.call_object(c)) for c in calls) + self.close

    def field_prefix(self, tool: str, key: str) -> str:
        """The response text a first call of ``tool`` has up to ``key``'s colon: the context a
        SIDE branch (and Parallel Fill) writes the key's value after."""
        return self.header + self.call_header(tool) + dumps(key) + ":"

    def decode(self, tokenizer: Any, ids: list[int], **kwargs: Any) -> str:
        """The response text of token ``ids``: special tokens dropped, but for this format's
        lead marker, which the parser must see where a vocabulary holds it as a control token
        (Mistral's ``[TOOL_CALLS]``; vLLM's mistral parser keeps special tokens for it too).
        ``kwargs`` go to ``tokenizer.decode``."""
        if self.lead is not None:
            marker = tokenizer.convert_tokens_to_ids(self.lead)
            if marker is not None and marker != tokenizer.unk_token_id and marker in ids:
                added = getattr(tokenizer, "added_tokens_decoder", {})
                special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
                drop = special - {marker}
                return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False, **kwargs)
        return tokenizer.decode(ids, skip_special_tokens=True, **kwargs)

    def is_calls(self, text: str) -> bool | None:
        """True when ``text`` is a tool-call response, False when it is not, None while it is
        still a prefix of the marker and could become either (tagged and lead formats: after
        any whitespace, as their parsers read them)."""
        if self.in_words:
            text = text.lstrip(_WS)
        if text.startswith(self.marker):
            return True
        return None if self.marker.startswith(text) else False

    def complete(self, text: str, stop: str) -> bool:
        """Whether a decode that stopped for ``stop`` (closed | eos | length) wrote a whole
        response: its closing text, or (formats that EOS ends) an EOS after whole calls."""
        if self.self_closing:
            return stop == "closed"
        return stop == "eos" and self.parse(text.strip()) is not None

    def parse(self, text: str) -> list | None:
        """The call objects of a complete response (unvalidated), [] for a reply without calls
        in a tagged or lead format, or None when the text is not one well-formed response."""
        if self.bare is not None:
            try:
                obj = json.loads(text)
            except ValueError:
                return None
            return [{"name": self.bare, "arguments": obj}] if isinstance(obj, dict) else None
        if self.lead is not None:
            text = text.strip(_WS)
            if not text.startswith(self.lead):
                return [] if self.lead not in text else None  # a reply in words, or text before the calls
            try:
                calls = json.loads(text[len(self.lead):])
            except ValueError:
                return None
            return calls if isinstance(calls, list) else None
        if self.open_tag is None:
            try:
                obj = json.loads(text)
            except ValueError:
                return None
            return obj[KEY] if isinstance(obj, dict) and isinstance(obj.get(KEY), list) else None
        if self.open_tag not in text:
            return []  # a reply in words
        blocks = _tag_blocks(self.open_tag, self.close_tag)
        if blocks.sub("", text).strip():  # text around or between the blocks, or an unclosed block
            return None
        try:
            return [json.loads(body) for body in blocks.findall(text)]
        except ValueError:
            return None

    def call_spans(self, text: str) -> list["CallSpan"]:
        """The calls a tool-call response holds so far, their arguments as raw text.

        Works on every prefix of a response, and only grows with it: a call appears once its
        object opens, its name once the name string closes (the first ``name`` wins, as the
        first ``arguments`` does), its arguments text extends with every character of the value
        written so far. So a stream of these views and the view of the finished response agree;
        reading stops quietly where the text stops being a response."""
        calls: list[CallSpan] = []
        if self.bare is not None:  # the whole text is the one call's arguments
            i = _skip_ws(text, 0)
            if i < len(text):
                end = _value_end(text, i)
                calls.append(CallSpan(self.bare, text[i:end if end is not None else len(text)], end is not None,
                                      end is not None))
            return calls
        if self.open_tag is None:
            if self.lead is not None:  # the marker, then the list's "[" after any whitespace
                i = _skip_ws(text, 0)
                if not text.startswith(self.lead, i):
                    return calls
                i = _skip_ws(text, i + len(self.lead))
                if not text.startswith("[", i):
                    return calls
                i += 1
            elif not text.startswith(self.header):
                return calls
            else:
                i = len(self.header)
            while True:
                i = _skip_ws(text, i)
                if i < len(text) and text[i] == ",":
                    i += 1
                    continue
                if i >= len(text) or text[i] != "{":
                    return calls
                i = _read_call(text, i, calls)
                if i is None:
                    return calls
        i = 0
        while True:
            i = _skip_ws(text, i)
            if not text.startswith(self.open_tag, i):
                return calls
            i = _skip_ws(text, i + len(self.open_tag))
            if i >= len(text) or text[i] != "{":
                return calls
            i = _read_call(text, i, calls)
            if i is None:
                return calls
            i = _skip_ws(text, i)
            if not text.startswith(self.close_tag, i):
                return calls
            i += len(self.close_tag)


JSON = ResponseFormat(
    name="json",
    header='{"' + KEY + '": [',
    call_bridge=", ",
    close="]}",
    self_closing=True,
    empty='{"' + KEY + '": []}',
    template='{"' + KEY + '": [' + CALL_EXAMPLE + ', ...]}',
)

HERMES = ResponseFormat(
    name="hermes",
    header="<tool_call>\n",
    call_bridge="\n</tool_call>\n<tool_call>\n",
    close="\n</tool_call>",
    self_closing=False,
    empty=NO_TOOL,
    template="<tool_call>\n" + CALL_EXAMPLE + "\n</tool_call>",
    open_tag="<tool_call>",
    close_tag="</tool_call>",
)

HERMES3 = replace(
    HERMES,
    name="hermes3",
    template="<tool_call>\n" + ARGS_FIRST_EXAMPLE + "\n</tool_call>",
    name_first=False,
)

MISTRAL = ResponseFormat(
    name="mistral",
    header="[TOOL_CALLS] [",
    call_bridge=", ",
    close="]",
    self_closing=True,
    empty=NO_TOOL,
    template="[TOOL_CALLS] [" + CALL_EXAMPLE + ", ...]",
    lead="[TOOL_CALLS]",
)

FORMATS = {f.name: f for f in (JSON, HERMES, HERMES3, MISTRAL)}

OBJECT = ResponseFormat(
    name="object",
    header="",
    call_bridge="",
    close="",
    self_closing=True,
    empty="{}",
    template='{"<field>": <JSON value>, ...}',
    bare="",
)


def object_format(schema_name: str) -> ResponseFormat:
    """The format of a structured output (a ``response_format`` JSON schema named
    ``schema_name``): the response is the object itself, which SchemaFill's slot machinery
    reads as the arguments of one call of that schema, its fields the slots."""
    return replace(OBJECT, bare=schema_name)


# ------------------------------------------------------------------------- reading calls back
@dataclass
class CallSpan:
    """One call as far as a (possibly unfinished) response has written it."""

    name: str | None = None  # once its string is complete
    arguments: str = ""  # the raw text of its arguments value so far
    arguments_done: bool = False
    closed: bool = False  # the call object's closing brace has been written


def _tag_blocks(open_tag: str, close_tag: str) -> re.Pattern:
    return re.compile(re.escape(open_tag) + r"\s*(.*?)\s*" + re.escape(close_tag), re.DOTALL)


def _read_call(text: str, i: int, calls: list[CallSpan]) -> int | None:
    """Read the call object opening at ``text[i]`` into a new span of ``calls``; the index
    after its closing brace, or None where the text stops (or stops being a call) inside it."""
    call = CallSpan()
    calls.append(call)
    i, n = i + 1, len(text)
    while True:
        i = _skip_ws(text, i)
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "}":
            call.closed = True
            return i + 1
        if i >= n or text[i] != '"':
            return None
        key_end = _string_end(text, i)
        if key_end is None:
            return None
        key = text[i + 1:key_end - 1]
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return None
        i = _skip_ws(text, i + 1)
        if i >= n:
            return None
        end = _value_end(text, i)
        if key == "arguments" and not call.arguments:
            call.arguments, call.arguments_done = text[i:end if end is not None else n], end is not None
        elif key == "name" and call.name is None and end is not None and text[i] == '"':
            try:
                call.name = json.loads(text[i:end])
            except ValueError:
                return None
        if end is None:
            return None
        i = end


_WS = " \t\n\r"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string opening at ``i``, or None when the text ends inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``i``, or None when the text ends inside it."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                if j is None:
                    return None
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: it ends at a delimiter
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


CONTINUATION_TAIL = 16  # committed tokens re-tokenised with a suffix: merges reach back a word, not a response


def continuation_ids(tokenizer: Any, committed: list[int], text: str, suffix: str,
                     fmt: ResponseFormat = JSON) -> list[int]:
    """Tokens for ``suffix`` after ``committed`` (whose text the packer saw as ``text``) as the
    whole response would be tokenised (BPE merges across the boundary), falling back to
    the suffix alone; nothing while the parsed text lags (a split multi-byte character).

    Only the response's last ``CONTINUATION_TAIL`` tokens are tokenised again with the suffix,
    where they come back as they were (merges do not reach further back): a round's packing
    costs its suffix, not the whole response; otherwise the whole text is."""
    return continuations(tokenizer, committed, text, [suffix], fmt)[0]


def continuations(tokenizer: Any, committed: list[int], text: str, suffixes: list[str],
                  fmt: ResponseFormat = JSON) -> list[list[int]]:
    """``continuation_ids`` of each of ``suffixes``, the committed tail decoded once and every
    suffix tokenised in one call."""
    out: list[list[int] | None] = [[] if not suffix else None for suffix in suffixes]
    todo = [i for i, o in enumerate(out) if o is None]
    if todo and len(committed) > CONTINUATION_TAIL:
        tail_ids = committed[-CONTINUATION_TAIL:]
        tail = fmt.decode(tokenizer, tail_ids)
        if tail and not tail.endswith("\ufffd") and text.endswith(tail):
            batch = tokenizer([tail + suffixes[i] for i in todo], add_special_tokens=False).input_ids
            for i, ids in zip(todo, batch):
                if ids[:CONTINUATION_TAIL] == tail_ids and len(ids) > CONTINUATION_TAIL:
                    out[i] = ids[CONTINUATION_TAIL:]
            todo = [i for i in todo if out[i] is None]
    if todo and fmt.decode(tokenizer, committed) != text:
        return [o or [] for o in out]
    for i in todo:
        full = tokenizer(text + suffixes[i], add_special_tokens=False).input_ids
        if full[: len(committed)] == committed and len(full) > len(committed):
            out[i] = full[len(committed):]
        else:
            out[i] = tokenizer(suffixes[i], add_special_tokens=False).input_ids
    return out


def stable_continuation_ids(tokenizer: Any, committed: list[int], text: str, suffix: str, then: str = "",
                            fmt: ResponseFormat = JSON) -> list[int]:
    """``continuation_ids`` of ``suffix`` up to its last token that none of the characters in
    ``then`` (what may come next) would merge with: the tokens it shares with the suffix
    continued by each. Whether ``": "`` ends in a space token before a number is the
    tokenizer's to say (its own before a digit, merged with a quote or a letter); without
    ``then``, a trailing space is dropped, as most tokenizers merge it with the word after."""
    if not then:
        return continuation_ids(tokenizer, committed, text, suffix.rstrip(" "), fmt)
    ids, *longer = continuations(tokenizer, committed, text, [suffix] + [suffix + c for c in then], fmt)
    n = len(ids)
    for other in longer:
        n = next((i for i, (a, b) in enumerate(zip(ids[:n], other)) if a != b), min(n, len(other)))
    return ids[:n]
