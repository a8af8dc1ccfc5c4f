"""Incremental parser of a (partial) tool-call response.

Owns one question: given the text committed so far, where are we in
``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` (or in the calls of another
``ResponseFormat``: hermes' ``<tool_call>`` blocks, or mistral's list after its marker, read as
that same list)? The SchemaFill
decoder asks it after every round (which call, which tool, which field, inside a
value or in structural text, is the outer object closed) and SIDE branches ask it
when a drafted value literal has closed.

It is a character-level JSON pushdown automaton, so it accepts any whitespace and
any key order the target chooses, and is fed text incrementally (``feed``) so a
decode loop pays only for the new characters. A tagged format's tags are matched as
literals outside the call objects and stand for the list's brackets and commas, and a lead
format's marker is a literal before its list, so every offset still counts characters of the
real response. Pure: standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dc_field

from schemafill.contract.response_format import JSON, KEY, ResponseFormat

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_VALUE_TYPES = {'"': "string", "{": "object", "[": "array", "t": "boolean", "f": "boolean", "n": "null"}


@dataclass(frozen=True)
class ParseState:
    """Where a partial response stands. Offsets count characters of the text fed."""

    closed: bool = False  # the outer object is complete (formats whose EOS ends the response: never)
    error: str | None = None  # the text is not a prefix of any JSON value
    calls_started: int = 0  # call objects opened so far
    call_index: int | None = None  # 0-based index of the call object we are inside
    tool_name: str | None = None  # that call's name, once its string has closed
    field: str | None = None  # last completed argument key of that call (kept after its value)
    in_key: bool = False  # inside an argument key string
    in_value: bool = False  # inside an argument value literal (any depth)
    value_type: str | None = None  # JSON type of the open value: string|number|boolean|null|object|array
    value_start: int | None = None  # offset of the first character of the current/last value
    # the innermost open string or number inside the value, as (string|number, its text so far,
    # JSON escapes kept; a string's without its quote), else None
    literal: tuple[str, str] | None = None
    fields_done: tuple[str, ...] = ()  # keys of the current call whose values have closed
    spans: tuple[tuple[str, int, int], ...] = ()  # (key, start, end) of those values' literals
    call_start: int | None = None  # offset of the current call's "{" (None outside a call)
    last_call_end: int | None = None  # offset just past the "}" of the last closed call


@dataclass(frozen=True)
class CallLayout:
    """One call of a response: its tool and where each argument value's literal lies."""

    name: str | None
    spans: tuple[tuple[str, int, int], ...]  # (key, start, end) offsets into the response text


@dataclass
class _Frame:
    kind: str  # "obj" | "arr"
    state: str  # obj: key_or_end, key, colon, value, comma_or_end; arr: value_or_end, value, comma_or_end
    key: str | None = None  # obj: key of the member being written
    index: int = -1  # arr: index of the element being written


@dataclass
class _Call:
    start: int = 0
    name: str | None = None
    field: str | None = None
    fields_done: list[str] = dc_field(default_factory=list)
    spans: list[tuple[str, int, int]] = dc_field(default_factory=list)
    end: int | None = None


class ToolCallParser:
    """Feed text; read ``state``. Once an error is found the parser stops consuming."""

    def __init__(self, fmt: ResponseFormat = JSON) -> None:
        self._fmt = fmt
        # tagged formats, outside the call objects: start | call | after_call | between;
        # lead formats: start | lead (the marker read) | list
        self._outer = "start"
        self._tag: tuple[str, int] | None = None  # (literal tag being matched, characters matched)
        self._stack: list[_Frame] = []
        self._scalar: list | None = None  # [kind, raw_chars, extra]
        self._root_done = False
        self._root_is_object = False
        self._root_closed_object = False
        self._error: str | None = None
        self._offset = 0
        self._calls: list[_Call] = []
        self._value_start: int | None = None
        self._value_type: str | None = None
        self._value_depth: int | None = None  # stack depth of the arguments frame owning the open value
        if fmt.bare is not None:  # a structured output: the text is one call's arguments object
            self._stack = [_Frame("obj", "value", key=KEY), _Frame("arr", "value", index=0),
                           _Frame("obj", "value", key="arguments")]
            self._calls = [_Call(start=0, name=fmt.bare)]

    # ------------------------------------------------------------------ feeding
    def feed(self, text: str) -> ParseState:
        for ch in text:
            if self._error is not None:
                break
            self._step(ch)
            self._offset += 1
        return self.state

    def _fail(self, reason: str) -> None:
        self._error = f"{reason} at offset {self._offset}"

    def _step(self, ch: str) -> None:
        if self._scalar is not None:
            kind = self._scalar[0]
            if kind == "string":
                self._string_char(ch)
                return
            if kind == "number":
                if ch in _NUMBER_CHARS:
                    self._scalar[1].append(ch)
                    return
                self._close_number()
                if self._error is not None:
                    return
                # the delimiter belongs to the enclosing structure
            else:  # literal
                raw, target = self._scalar[1], self._scalar[2]
                raw.append(ch)
                if target[: len(raw)] != "".join(raw):
                    self._fail(f"invalid literal {''.join(raw)!r}")
                elif len(raw) == len(target):
                    self._scalar = None
                    self._value_closed()
                return
        self._structural(ch)

    def _structural(self, ch: str) -> None:
        if self._fmt.open_tag is not None and self._outer != "call":
            self._between_tags(ch)
            return
        if self._fmt.lead is not None and self._outer != "list":
            self._before_list(ch)
            return
        if ch in _WHITESPACE:
            return
        if self._root_done:
            self._fail("text after the closed outer object")
            return
        if not self._stack:
            self._root_is_object = ch == "{"
            self._start_value(ch)
            return
        if self._fmt.bare is not None and len(self._stack) == 3 and ch != "{":
            self._fail(f"a structured output is one object: expected '{{', got {ch!r}")
            return
        top = self._stack[-1]
        if top.kind == "obj":
            if top.state in ("key_or_end", "key"):
                if ch == '"':
                    self._scalar = ["string", [], {"is_key": True, "escape": 0}]
                elif ch == "}" and top.state == "key_or_end":
                    self._close_container()
                else:
                    self._fail(f"expected a key, got {ch!r}")
            elif top.state == "colon":
                if ch == ":":
                    top.state = "value"
                else:
                    self._fail(f"expected ':', got {ch!r}")
            elif top.state == "value":
                self._start_value(ch)
            else:  # comma_or_end
                if ch == ",":
                    top.state, top.key = "key", None
                elif ch == "}":
                    self._close_container()
                else:
                    self._fail(f"expected ',' or '}}', got {ch!r}")
        else:
            if top.state in ("value_or_end", "value"):
                if ch == "]" and top.state == "value_or_end":
                    self._close_container()
                else:
                    top.index += 1
                    self._start_value(ch)
            else:  # comma_or_end
                if ch == ",":
                    top.state = "value"
                elif ch == "]":
                    self._close_container()
                else:
                    self._fail(f"expected ',' or ']', got {ch!r}")

    def _between_tags(self, ch: str) -> None:
        """A tagged format outside its call objects: whitespace, or the tags as literals."""
        if self._tag is None and ch in _WHITESPACE:
            return
        if self._tag is not None:  # inside a tag
            tag = self._tag[0]
        else:
            tag = self._fmt.close_tag if self._outer == "after_call" else self._fmt.open_tag
        if self._literal(ch, tag):
            self._tag_closed(tag)

    def _before_list(self, ch: str) -> None:
        """A lead format before its list: whitespace, the lead marker as a literal, whitespace,
        and the list's ``[``, which stands where the json format's list opens."""
        if self._tag is None and ch in _WHITESPACE:
            return
        if self._tag is not None or self._outer == "start":
            if self._literal(ch, self._fmt.lead):
                self._outer = "lead"
        elif ch != "[":
            self._fail(f"expected '[', got {ch!r}")
        else:
            self._outer = "list"
            self._stack = [_Frame("obj", "value", key=KEY)]
            self._start_value(ch)

    def _literal(self, ch: str, literal: str) -> bool:
        """Match ``ch`` against the format's literal (a tag or marker) being read; True once whole."""
        matched = self._tag[1] if self._tag else 0
        if ch != literal[matched]:
            self._fail(f"expected {literal!r}" + ("" if matched else f", got {ch!r}"))
            return False
        self._tag = (literal, matched + 1) if matched + 1 < len(literal) else None
        return self._tag is None

    def _tag_closed(self, tag: str) -> None:
        if tag == self._fmt.close_tag:
            self._outer = "between"
            return
        # an open tag stands for the list's "[" (first call) or ",": the call's value comes next
        if not self._stack:
            self._stack = [_Frame("obj", "value", key=KEY), _Frame("arr", "value")]
        self._stack[1].state = "value"
        self._outer = "call"

    # ------------------------------------------------------------------ values
    def _start_value(self, ch: str) -> None:
        if self._in_arguments_frame():
            self._value_start = self._offset
            self._value_type = "number" if ch in _NUMBER_CHARS else _VALUE_TYPES.get(ch)
            self._value_depth = len(self._stack)
        if ch == "{":
            self._push(_Frame("obj", "key_or_end"))
        elif ch == "[":
            self._push(_Frame("arr", "value_or_end"))
        elif ch == '"':
            self._scalar = ["string", [], {"is_key": False, "escape": 0}]
        elif ch in _LITERALS:
            self._scalar = ["literal", [ch], _LITERALS[ch]]
        elif ch in "-0123456789":
            self._scalar = ["number", [ch], None]
        else:
            self._fail(f"expected a value, got {ch!r}")

    def _push(self, frame: _Frame) -> None:
        if frame.kind == "obj" and self._writing_call():
            self._calls.append(_Call(start=self._offset))
            self._value_start = None
        self._stack.append(frame)

    def _string_char(self, ch: str) -> None:
        raw, extra = self._scalar[1], self._scalar[2]
        if extra["escape"] == 1:  # the character after a backslash
            if ch == "u":
                extra["escape"] = 5  # four hex digits follow
            elif ch in '"\\/bfnrt':
                extra["escape"] = 0
            else:
                self._fail(f"invalid escape \\{ch}")
                return
            raw.append(ch)
            return
        if extra["escape"] > 1:
            if ch not in "0123456789abcdefABCDEF":
                self._fail("invalid \\u escape")
                return
            extra["escape"] = 0 if extra["escape"] == 2 else extra["escape"] - 1
            raw.append(ch)
            return
        if ch == "\\":
            extra["escape"] = 1
            raw.append(ch)
            return
        if ch == '"':
            text = json.loads('"' + "".join(raw) + '"')
            self._scalar = None
            if extra["is_key"]:
                self._key_closed(text)
            else:
                self._string_value_closed(text)
            return
        if ch < " ":
            self._fail("control character in string")
            return
        raw.append(ch)

    def _key_closed(self, key: str) -> None:
        top = self._stack[-1]
        top.key, top.state = key, "colon"
        if self._in_arguments_frame():
            call = self._calls[-1]
            call.field = key

    def _string_value_closed(self, text: str) -> None:
        path = self._path()
        if len(path) == 3 and path[0] == KEY and path[2] == "name" and self._calls:
            self._calls[-1].name = text
        self._value_closed()

    def _close_number(self) -> None:
        raw = "".join(self._scalar[1])
        self._scalar = None
        try:
            json.loads(raw)
        except ValueError:
            self._fail(f"invalid number {raw!r}")
            return
        self._value_closed(end=self._offset)  # the delimiter is not part of the number

    def _close_container(self) -> None:
        frame = self._stack.pop()
        if frame.kind == "obj" and self._writing_call() and self._calls:
            self._calls[-1].end = self._offset + 1
        self._value_closed()

    def _value_closed(self, end: int | None = None) -> None:
        """A complete value ended; the enclosing frame now expects ',' or its close."""
        if self._value_depth is not None and len(self._stack) == self._value_depth:
            self._value_depth = None
            self._value_type = None
            key = self._stack[-1].key
            self._calls[-1].fields_done.append(key)
            self._calls[-1].spans.append((key, self._value_start, self._offset + 1 if end is None else end))
        if not self._stack:
            self._root_done = True
            self._root_closed_object = self._root_is_object
            return
        self._stack[-1].state = "comma_or_end"
        if self._fmt.bare is not None and len(self._stack) == 3:  # the object, and with it the response, closed
            self._calls[-1].end = self._offset + 1
            self._stack.clear()
            self._root_done = self._root_closed_object = True
            return
        if self._fmt.lead is not None and len(self._stack) == 1:  # the list closed, and with it the response
            self._stack.pop()
            self._root_done = self._root_closed_object = True
            return
        if self._fmt.open_tag is not None and len(self._stack) == 2:
            self._outer = "after_call"  # the value between two tags is complete: the close tag comes next

    # ------------------------------------------------------------------ paths
    def _path(self) -> tuple:
        """Keys/indices from the root to the value the top frame is writing."""
        out = []
        for frame in self._stack:
            out.append(frame.key if frame.kind == "obj" else frame.index)
        return tuple(out)

    def _writing_call(self) -> bool:
        """True when the next value is an element of the outer ``tool_calls`` list."""
        return (
            len(self._stack) == 2 and self._stack[0].kind == "obj" and self._stack[0].key == KEY
            and self._stack[1].kind == "arr"
        )

    def _in_arguments_frame(self) -> bool:
        """True when the top frame is a call's ``arguments`` object."""
        if len(self._stack) != 4 or self._stack[-1].kind != "obj":
            return False
        root, calls, call = self._stack[0], self._stack[1], self._stack[2]
        return (
            root.kind == "obj" and root.key == KEY and calls.kind == "arr"
            and call.kind == "obj" and call.key == "arguments"
        )

    # ------------------------------------------------------------------ state
    @property
    def layout(self) -> tuple[CallLayout, ...]:
        return tuple(CallLayout(c.name, tuple(c.spans)) for c in self._calls)

    @property
    def state(self) -> ParseState:
        depth = len(self._stack)
        in_call = (
            depth >= 3 and self._stack[0].key == KEY and self._stack[1].kind == "arr"
            and self._stack[2].kind == "obj" and bool(self._calls)
        )
        call = self._calls[-1] if in_call else None
        in_args = in_call and depth >= 4 and self._stack[2].key == "arguments" and self._stack[3].kind == "obj"
        in_key = (
            in_args and depth == 4 and self._scalar is not None and self._scalar[0] == "string"
            and self._scalar[2]["is_key"]
        )
        in_value = in_args and self._value_depth is not None
        return ParseState(
            closed=self._root_closed_object,
            error=self._error,
            calls_started=len(self._calls),
            call_index=len(self._calls) - 1 if in_call else None,
            tool_name=call.name if call else None,
            field=call.field if in_args else None,
            in_key=bool(in_key),
            in_value=in_value,
            value_type=self._value_type if in_value else None,
            value_start=self._value_start if in_args else None,
            literal=self._open_literal() if in_value else None,
            fields_done=tuple(call.fields_done) if call else (),
            spans=tuple(call.spans) if call else (),
            call_start=call.start if call else None,
            last_call_end=next((c.end for c in reversed(self._calls) if c.end is not None), None),
        )


    def _open_literal(self) -> tuple[str, str] | None:
        scalar = self._scalar
        if scalar is None or scalar[0] == "literal" or (scalar[0] == "string" and scalar[2]["is_key"]):
            return None
        return scalar[0], "".join(scalar[1])


def parse_prefix(text: str, fmt: ResponseFormat = JSON) -> ParseState:
    """State after feeding ``text`` to a fresh parser."""
    return ToolCallParser(fmt).feed(text)


def response_layout(text: str, fmt: ResponseFormat = JSON) -> tuple[CallLayout, ...]:
    """Every call opened in ``text``, in order (the skeleton Parallel Fill fills)."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    return parser.layout
