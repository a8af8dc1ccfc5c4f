"""The response format, in one place: the canonical text of a tool-call response (DESIGN §2).

    {"tool_calls": [{"name": "t", "arguments": {"k": v, ...}}, ...]}

Everything that writes or predicts response text takes its pieces from here: the
serializer (``toolcall``), the prompt's format instructions (``prompt``), the packer's
bridges between fields and calls, the headers of SIDE branches and Parallel Fill's
contexts, the separators of the response grammar (``infer/constraint``), and reading
the calls back out of a response, finished or not (``call_spans``: the server's answers). Its texts
tokenize alike wherever they appear because they are the same strings. Pure: standard
library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KEY = "tool_calls"
# what `json.dumps` writes by default and what prompts show the target, so MAIN and SIDE
# texts tokenize the same way
SEPARATORS = (", ", ": ")
HEADER = '{"' + KEY + '": ['  # the response up to its first call
FIELD_BRIDGE = ", "  # between two arguments of a call
CALL_BRIDGE = ", "  # between two calls
CALL_CLOSE = "}}"  # a call's arguments, then the call
CLOSE = "]}"  # the list of calls, then the response
TEMPLATE = '{"' + KEY + '": [{"name": "<tool name>", "arguments": {"<argument>": <JSON value>, ...}}, ...]}'
EMPTY = '{"' + KEY + '": []}'


def dumps(value: Any) -> str:
    """Canonical JSON text of one value (unicode kept, the canonical separators)."""
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


def serialize(calls: list[dict]) -> str:
    """The response text of ``calls`` (each ``{"name": ..., "arguments": {...}}``)."""
    return dumps({KEY: calls})


def call_header(tool: str) -> str:
    """A call of ``tool`` up to its first argument's key."""
    return '{"name": ' + dumps(tool) + ', "arguments": {'


def field_prefix(tool: str, key: str) -> str:
    """The response text a first call of ``tool`` has up to ``key``'s colon: the context a
    SIDE branch (and Parallel Fill) writes the key's value after."""
    return HEADER + call_header(tool) + dumps(key) + ":"


# ------------------------------------------------------------------------- reading calls back
@dataclass
class CallSpan:
    """One call as far as a (possibly unfinished) response has written it."""

    name: str | None = None  # once its string is complete
    arguments: str = ""  # the raw text of its arguments value so far
    arguments_done: bool = False
    closed: bool = False  # the call object's closing brace has been written


def is_calls(text: str) -> bool | None:
    """True when ``text`` is a tool-call response, False when it is not, None while it is still
    a prefix of the header and could become either."""
    if text.startswith(HEADER):
        return True
    return None if HEADER.startswith(text) else False


def call_spans(text: str) -> list[CallSpan]:
    """The calls a tool-call response holds so far, their arguments as raw text.

    Works on every prefix of a response, and only grows with it: a call appears once its
    object opens, its name once the name string closes (the first ``name`` wins, as the
    first ``arguments`` does), its arguments text extends with every character of the value
    written so far. So a stream of these views and the view of the finished response agree;
    reading stops quietly where the text stops being a response."""
    calls: list[CallSpan] = []
    if not text.startswith(HEADER):
        return calls
    i, n = len(HEADER), len(text)
    while True:
        i = _skip_ws(text, i)
        if i < n and text[i] == ",":
            i += 1
            continue
        if i >= n or text[i] != "{":
            return calls
        call = CallSpan()
        calls.append(call)
        i += 1
        while True:  # the call's members
            i = _skip_ws(text, i)
            if i < n and text[i] == ",":
                i += 1
                continue
            if i < n and text[i] == "}":
                call.closed = True
                i += 1
                break
            if i >= n or text[i] != '"':
                return calls
            key_end = _string_end(text, i)
            if key_end is None:
                return calls
            key = text[i + 1:key_end - 1]
            i = _skip_ws(text, key_end)
            if i >= n or text[i] != ":":
                return calls
            i = _skip_ws(text, i + 1)
            if i >= n:
                return calls
            end = _value_end(text, i)
            if key == "arguments" and not call.arguments:
                call.arguments, call.arguments_done = text[i:end if end is not None else n], end is not None
            elif key == "name" and call.name is None and end is not None and text[i] == '"':
                try:
                    call.name = json.loads(text[i:end])
                except ValueError:
                    return calls
            if end is None:
                return calls
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
