"""The incremental parser against an independent oracle.

The oracle serializes a response piece by piece and records where each call, name, key
and value starts and ends; the expected state of every prefix follows from those spans
alone, without running a JSON parser.
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemafill.contract.parser import ToolCallParser, parse_prefix
from schemafill.contract.toolcall import ToolCall, serialize_calls


def _dump(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def build(calls: list[ToolCall]):
    """Canonical text plus spans: per call (start, end, name_span, [(key, key_span, value_span, type)])."""
    text = '{"tool_calls": ['
    layout = []
    for j, call in enumerate(calls):
        if j:
            text += ", "
        call_start = len(text)
        text += '{"name": '
        name_span = (len(text), len(text) + len(_dump(call.name)))
        text += _dump(call.name) + ', "arguments": {'
        fields = []
        for i, (key, value) in enumerate(call.arguments.items()):
            if i:
                text += ", "
            key_span = (len(text), len(text) + len(_dump(key)))
            text += _dump(key) + ": "
            value_span = (len(text), len(text) + len(_dump(value)))
            text += _dump(value)
            fields.append((key, key_span, value_span, _type(value)))
        text += "}}"
        layout.append((call_start, len(text), name_span, fields))
    text += "]}"
    return text, layout


def _type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def expected(text: str, layout, n: int) -> dict:
    """State of text[:n], from spans only."""
    exp = dict(closed=n == len(text), calls_started=0, call_index=None, tool_name=None, field=None,
               in_key=False, in_value=False, value_type=None)
    for j, (start, end, name_span, fields) in enumerate(layout):
        if n > start:
            exp["calls_started"] = j + 1
        if not start < n < end:  # call object opened and not yet closed
            continue
        exp["call_index"] = j
        if n >= name_span[1]:
            exp["tool_name"] = None  # filled below from the call itself
        args_close = end - 2  # index of the arguments object's "}" (the call's follows)
        for key, (ks, ke), (vs, ve), vtype in fields:
            if n >= ke and n <= args_close:
                exp["field"] = key
            if ks < n < ke:
                exp["in_key"] = True
            open_value = vs < n <= ve if vtype == "number" else vs < n < ve
            if open_value:
                exp["in_value"], exp["value_type"] = True, vtype
    return exp


_key = st.text(alphabet=string.ascii_letters + "_é中\"\\", min_size=1, max_size=6)
_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(alphabet=string.printable + "ü日本\u2028", max_size=8),
)
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_key, inner, max_size=3)), max_leaves=6)
_call = st.builds(ToolCall, name=st.text(alphabet=string.ascii_letters + "._-", min_size=1, max_size=10),
                  arguments=st.dictionaries(_key, _value, max_size=4))


@settings(max_examples=150, deadline=None)
@given(st.lists(_call, min_size=1, max_size=3))
def test_every_prefix_matches_the_oracle(calls):
    text, layout = build(calls)
    assert text == serialize_calls(calls)  # the oracle writes the canonical format
    parser = ToolCallParser()
    for n in range(len(text) + 1):
        state = parser.feed(text[n - 1]) if n else parser.state
        exp = expected(text, layout, n)
        got = {k: getattr(state, k) for k in exp}
        if exp["call_index"] is not None and n >= layout[exp["call_index"]][2][1]:
            exp["tool_name"] = calls[exp["call_index"]].name
        assert state.error is None, (n, text[:n], state.error)
        assert got == exp, (n, text[:n])


@settings(max_examples=50, deadline=None)
@given(st.lists(_call, min_size=1, max_size=3), st.integers(1, 7))
def test_chunked_feeding_equals_whole_feeding(calls, chunk):
    text = serialize_calls(calls)
    parser = ToolCallParser()
    for i in range(0, len(text), chunk):
        parser.feed(text[i:i + chunk])
    assert parser.state == parse_prefix(text)
    assert parser.state.closed


def test_literal_states_along_a_response():
    text = '{"tool_calls": [{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}]}'
    at = lambda s: parse_prefix(text[: text.index(s) + len(s)])  # noqa: E731
    assert at('"name": "spot').tool_name is None and at('"name": "spot').call_index == 0
    assert at('"spotify.play"').tool_name == "spotify.play"
    s = at('"artist": "Tay')
    assert (s.field, s.in_value, s.value_type, s.literal) == ("artist", True, "string", ("string", "Tay"))
    assert at('"artist": "').literal == ("string", "") and at('"arti').literal is None  # a key is no value
    s = at('"Taylor Swift"')
    assert (s.field, s.in_value, s.fields_done) == ("artist", False, ("artist",))
    s = at('"duration": 20')
    assert (s.field, s.in_value, s.value_type) == ("duration", True, "number")  # 20 may go on: 200
    assert s.literal == ("number", "20") and at('"Taylor Swift"').literal is None
    s = at('"duration": 20}')
    assert (s.field, s.in_value, s.fields_done) == (None, False, ("artist", "duration"))
    assert parse_prefix(text).closed and not at('}}').closed


def test_any_whitespace_and_key_order():
    text = '{ "tool_calls" :[\n {"arguments":{"a" : [1, {"b": null}] ,"c":true},\n"name":"f"}\n,{"name":"g","arguments":{}} ] }'
    parser = ToolCallParser()
    parser.feed(text[: text.index('"name":"f"') + 10])
    assert (parser.state.tool_name, parser.state.fields_done) == ("f", ("a", "c"))
    parser.feed(text[text.index('"name":"f"') + 10:])
    assert parser.state.closed and parser.state.calls_started == 2 and parser.state.error is None


def test_value_start_offsets_point_at_the_value():
    text = '{"tool_calls": [{"name": "f", "arguments": {"x": "hi", "y": -1.5e3'
    state = parse_prefix(text)
    assert text[state.value_start:] == "-1.5e3" and state.in_value
    state = parse_prefix(text + "}")
    assert state.value_start is None and state.fields_done == ("x", "y")  # arguments closed


@pytest.mark.parametrize("bad", ['{"tool_calls": [}', '{"a" 1}', '{"tool_calls": [tru', '{"x": "\\q"}',
                                 '{"x": 1.2.3}', '{"x": 1} x'])
def test_invalid_text_reports_an_error(bad):
    state = parse_prefix(bad)
    if bad == '{"tool_calls": [tru':
        assert state.error is None  # a valid prefix of `true`
        assert parse_prefix(bad + "x").error is not None
    else:
        assert state.error is not None


def test_only_an_outer_object_closes_the_response():
    assert not parse_prefix("[]").closed and not parse_prefix('"x"').closed
    assert parse_prefix('{"tool_calls": []}').closed


def test_nested_keys_do_not_change_the_field():
    text = '{"tool_calls": [{"name": "f", "arguments": {"outer": {"inner": 1, "deeper": {"k": "v"}'
    state = parse_prefix(text)
    assert (state.field, state.in_value, state.value_type) == ("outer", True, "object")



def test_the_open_literal_is_the_innermost_string_or_number():
    text = '{"tool_calls": [{"name": "f", "arguments": {"cities": ["Lima", "Qu'
    assert parse_prefix(text).literal == ("string", "Qu")  # inside the array's second element
    assert parse_prefix(text[:-4]).literal is None  # between the elements
    assert parse_prefix('{"tool_calls": [{"name": "f", "arguments": {"a": {"b": -1.5').literal == ("number", "-1.5")
    assert parse_prefix('{"tool_calls": [{"name": "f", "arguments": {"a": "x\\"').literal == ("string", 'x\\"')
    assert parse_prefix('{"tool_calls": [{"name": "f", "arguments": {"a": tr').literal is None  # true: no copy
