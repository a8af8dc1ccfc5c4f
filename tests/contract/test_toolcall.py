"""The tool-call contract: validation, normalisation, serialization, bad-input handling."""

from __future__ import annotations

import json

import pytest

from schemafill.contract.records import RejectLog, read_requests, write_requests
from schemafill.contract.toolcall import (
    InvalidRequest,
    ToolCall,
    ToolRequest,
    parse_response,
    serialize_calls,
)

GOOD = {
    "id": "r1", "source": "test", "category": "parallel",
    "messages": [{"role": "user", "content": "Play Taylor Swift for 20 minutes"}],
    "tools": [{"type": "function", "function": {
        "name": "spotify.play", "description": "Play music.",
        "parameters": {"type": "dict", "properties": {
            "artist": {"type": "string"}, "duration": {"type": "float"},
            "opts": {"type": "dict", "properties": {"shuffle": {"type": "boolean"}}},
            "ids": {"type": "tuple", "items": {"type": "dict", "properties": {}}}},
            "required": ["artist"]}}}],
    "reference": [{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}],
}


def test_valid_request_round_trips_and_normalises_bfcl_types():
    req = ToolRequest.from_dict(GOOD)
    params = req.functions[0]["parameters"]
    assert params["type"] == "object"
    assert params["properties"]["duration"]["type"] == "number"
    assert params["properties"]["opts"]["type"] == "object"
    assert params["properties"]["ids"] == {"type": "array", "items": {"type": "object", "properties": {}}}
    assert req.reference == [ToolCall("spotify.play", {"artist": "Taylor Swift", "duration": 20})]
    assert ToolRequest.from_dict(req.to_dict()) == req


def test_bare_function_tools_are_wrapped_in_openai_format():
    req = ToolRequest.from_dict({**GOOD, "tools": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]})
    assert req.tools == [{"type": "function", "function": {
        "name": "f", "description": "", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("patch,reason", [
    ({"tools": []}, "no tools"),
    ({"tools": {"name": "f"}}, "not a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "not a schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "not 'object'"),
    ({"tools": [{"function": {"description": "no name"}}]}, "has no name"),
    ({"messages": []}, "no messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"reference": [{"arguments": {}}]}, "has no name"),
    ({"id": ""}, "id"),
])
def test_invalid_requests_name_the_problem(patch, reason):
    with pytest.raises(InvalidRequest, match=reason):
        ToolRequest.from_dict({**GOOD, **patch})


def test_serialization_is_canonical_and_parses_back():
    calls = [ToolCall("a.b", {"s": "é\"\n", "n": 1.5, "l": [1, None, True], "o": {"x": {}}}), ToolCall("c", {})]
    text = serialize_calls(calls)
    assert text.startswith('{"tool_calls": [{"name": "a.b", "arguments": {"s": "é\\"\\n"')
    assert json.loads(text) == {"tool_calls": [c.to_dict() for c in calls]}
    assert parse_response(text) == calls
    assert parse_response(text[:-1]) is None
    assert parse_response('{"calls": []}') is None
    assert parse_response('{"tool_calls": [{"name": 3}]}') is None


def test_jsonl_with_malformed_lines_keeps_the_good_ones(tmp_path):
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({**GOOD, "id": "no_tools", "tools": []}),
        json.dumps({**GOOD, "id": "tools_not_list", "tools": "spotify"}),
        json.dumps({**GOOD, "id": "bad_params", "tools": [{"function": {"name": "f", "parameters": [1]}}]}),
        json.dumps({**GOOD, "id": "no_messages", "messages": []}),
        "",
        json.dumps({k: v for k, v in GOOD.items() if k != "id"}),  # no id: named by file and line
        "[1, 2]",
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    requests, log = read_requests(path)
    assert [r.id for r in requests] == ["r1", "requests:8"]
    assert [(r.line, r.id) for r in log.items] == [(2, None), (3, "no_tools"), (4, "tools_not_list"),
                                                   (5, "bad_params"), (6, "no_messages"), (9, None)]
    reasons = [r.reason for r in log.items]
    assert reasons[0].startswith("not JSON") and reasons[1] == "no tools"
    assert "not a list" in reasons[2] and "not a schema" in reasons[3] and reasons[4] == "no messages"
    assert log.counts()["no tools"] == 1 and len(log) == 6
    assert "6 records rejected" in log.summary() and "requests.jsonl:3 (id=no_tools): no tools" in log.summary()


def test_non_utf8_line_is_reported_not_fatal(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe{broken\n")
    requests, log = read_requests(path)
    assert [r.id for r in requests] == ["r1"] and log.items[0].line == 2 and "not UTF-8" in log.items[0].reason


def test_strict_mode_makes_a_bad_line_fatal(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "x", "tools": []}) + "\n")
    with pytest.raises(InvalidRequest, match=r"strict mode: .*requests.jsonl:2 \(id=x\): no tools"):
        read_requests(path, RejectLog(strict=True))


def test_write_then_read_is_lossless(tmp_path):
    req = ToolRequest.from_dict(GOOD)
    write_requests(tmp_path / "out.jsonl", [req, req])
    back, log = read_requests(tmp_path / "out.jsonl")
    assert back == [req, req] and len(log) == 0


def test_json_lines_name_a_bad_line_in_a_log_or_in_the_error(tmp_path):
    from schemafill.contract.records import RejectLog, json_lines

    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{broken\n\xff\xfe\n[2]\n')
    log = RejectLog()
    assert list(json_lines(path, log)) == [(1, {"a": 1}), (5, [2])]
    assert [(r.line, r.reason.split(":")[0]) for r in log.items] == [(3, "not JSON"), (4, "not UTF-8")]
    with pytest.raises(ValueError, match="x.jsonl:3"):
        list(json_lines(path))
