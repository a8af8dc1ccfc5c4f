"""Reading calls back out of responses, and streaming them: literal cases, then every
chunking of real responses (the concatenated stream equals the whole message)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.serving.message import MessageStream, finish_reason, message
from schemafill.contract.response_format import HERMES, JSON

call_spans, is_calls, serialize = JSON.call_spans, JSON.is_calls, JSON.serialize

CALLS = [{"name": "get_weather", "arguments": {"city": "Paris, \"FR\"", "days": 3}},
         {"name": "book", "arguments": {"when": {"day": "mon", "slots": [1, 2]}, "ok": True, "note": "é ✓ }"}}]
TEXT = serialize(CALLS)


def assemble(deltas: list[dict]) -> dict:
    """The message a client builds from streamed deltas (what the ``openai`` SDK's helpers
    and agent frameworks do): content concatenated, each call's arguments concatenated."""
    content, calls = None, {}
    for d in deltas:
        if d.get("content") is not None:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = tc.get("id") or call["id"]
            fn = tc.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": [calls[i] for i in sorted(calls)]}
    return {"role": "assistant", "content": content if content is not None else ""}


def ids(i: int) -> str:
    return f"call_{i}"


def test_call_spans_of_a_finished_response_are_its_calls_as_raw_text():
    spans = call_spans(TEXT)
    assert [s.name for s in spans] == ["get_weather", "book"]
    assert [json.loads(s.arguments) for s in spans] == [c["arguments"] for c in CALLS]
    assert all(s.closed and s.arguments_done for s in spans)
    assert TEXT.count(spans[1].arguments) == 1  # the value exactly as written, braces inside strings kept


def test_call_spans_of_prefixes():
    assert call_spans('{"tool_calls": [{"name": "get_wea') == [call_spans(TEXT)[0].__class__()]
    head = call_spans('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par')
    assert head[0].name == "get_weather" and head[0].arguments == '{"city": "Par' and not head[0].arguments_done
    scalar = call_spans('{"tool_calls": [{"name": "f", "arguments": 12')  # a number may still grow
    assert scalar[0].arguments == "12" and not scalar[0].arguments_done
    assert call_spans('{"tool_calls": []}') == []
    first = call_spans('{"tool_calls": [{"name": "a", "name": "b", "arguments": {}}]}')
    assert first[0].name == "a"  # the first name wins, so a stream never has to take one back


def test_is_calls_waits_on_a_header_prefix():
    assert is_calls("") is None and is_calls('{"tool_') is None
    assert is_calls('{"tool_calls": [') is True
    assert is_calls("Sure! Here") is False and is_calls('{"answer"') is False


def test_message_and_finish_reason():
    msg = message(TEXT, ids)
    assert msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "book"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [c["arguments"] for c in CALLS]
    assert [c["id"] for c in msg["tool_calls"]] == ["call_0", "call_1"]
    assert finish_reason(msg, "closed") == "tool_calls"
    assert finish_reason(msg, "length") == "length"
    assert finish_reason(message(TEXT[:-10], ids), "eos") == "stop"  # an EOS inside a call: nothing to run
    plain = message("I cannot help with that.", ids)
    assert plain == {"role": "assistant", "content": "I cannot help with that."}
    assert finish_reason(plain, "eos") == "stop"
    assert message(TEXT, ids, parse_calls=False)["content"] == TEXT  # tool_choice none
    assert finish_reason(message('{"tool_calls": []}', ids), "closed") == "stop"


def test_hermes_blocks_read_as_tool_calls():
    text = HERMES.serialize(CALLS)
    assert text.startswith("<tool_call>\n{") and text.count("</tool_call>") == 2
    msg = message(text, ids, fmt=HERMES)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "book"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [c["arguments"] for c in CALLS]
    # EOS ends a hermes response: whole blocks then EOS are calls to run, an EOS inside a block is not
    assert finish_reason(msg, "eos", text, HERMES) == "tool_calls"
    assert finish_reason(msg, "closed", text, HERMES) == "stop"  # never a reason of this format's decodes
    cut = text[:-5]
    assert finish_reason(message(cut, ids, fmt=HERMES), "eos", cut, HERMES) == "stop"
    words = "None of the available tools can do that."
    assert message(words, ids, fmt=HERMES) == {"role": "assistant", "content": words}
    assert HERMES.is_calls("<tool") is None and HERMES.is_calls("<tool_call>") is True
    assert HERMES.is_calls('{"tool_calls": [') is False  # the json format's header is content here
    for cuts in chunkings(text, random.Random(1), 20):
        assert streamed(text, cuts, fmt=HERMES) == msg


def test_stream_sends_the_name_first_then_argument_fragments():
    s = MessageStream(ids)
    assert s.feed('{"tool_calls": [{"na') == []
    assert s.feed('{"tool_calls": [{"name": "f", "arguments": {"a"') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}]
    assert s.feed('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    with pytest.raises(ValueError, match="only grow"):
        s.feed('{"tool_calls": [{"name": "g"')


def test_an_empty_reply_streams_empty_content():
    for text in ("", '{"tool_calls": []}', '{"tool_calls": ['):
        s = MessageStream(ids)
        deltas = s.feed(text) + s.feed(text, final=True)
        assert deltas[-1] == {"content": ""} and assemble(deltas) == message(text, ids) == \
            {"role": "assistant", "content": ""}


def chunkings(text: str, rng: random.Random, n: int) -> list[list[int]]:
    """``n`` random ways to cut ``text`` into growing prefixes (cut points), plus char by char."""
    cuts = [list(range(1, len(text) + 1))]
    for _ in range(n):
        k = rng.randint(1, max(1, len(text) // 3))
        cuts.append(sorted(set(rng.sample(range(1, len(text)), min(k, len(text) - 1)))) + [len(text)])
    return cuts


def streamed(text: str, cuts: list[int], parse_calls: bool = True, fmt=JSON) -> dict:
    s = MessageStream(ids, parse_calls, fmt)
    deltas = []
    for c in cuts:
        deltas += s.feed(text[:c], final=c == len(text))
    deltas += s.feed(text, final=True)
    return assemble(deltas)


RESPONSES = [TEXT, '{"tool_calls": []}', "plain words, no call", '{"tool_calls": [{"name": "f", "arguments": {"a": [1, {',
             '{"tool', '{"tool_calls": [{"arguments": {"x": 1}, "name": "late"}]}', "", serialize([CALLS[0]] * 3)]


@pytest.mark.parametrize("text", RESPONSES)
def test_any_chunking_streams_the_whole_message(text):
    rng = random.Random(0)
    for parse in (True, False):
        whole = message(text, ids, parse)
        for cuts in chunkings(text, rng, 40) if text else [[0]]:
            assert streamed(text, cuts, parse) == whole


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
                           max_leaves=8)


@pytest.mark.parametrize("fmt", [JSON, HERMES], ids=lambda f: f.name)
@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.fixed_dictionaries({"name": st.text(min_size=1, max_size=8),
                                             "arguments": st.dictionaries(st.text(max_size=5), json_values, max_size=3)}),
                      max_size=3),
       cut=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_streams_of_random_responses_and_their_truncations(fmt, calls, cut, seed):
    text = fmt.serialize(calls)
    text = text[: int(len(text) * cut)] or text  # a response the length cap cut anywhere
    whole = message(text, ids, fmt=fmt)
    for cuts in chunkings(text, random.Random(seed), 5):
        assert streamed(text, cuts, fmt=fmt) == whole
    if text == fmt.serialize(calls) and calls:
        got = whole.get("tool_calls", [])
        assert [c["function"]["name"] for c in got] == [c["name"] for c in calls]
        assert [json.loads(c["function"]["arguments"]) for c in got] == [c["arguments"] for c in calls]


def test_streams_token_by_token_with_the_real_tokenizer(smol_tokenizer):
    """Tokens as a decoder commits them, several per round, a multi-byte character split
    across tokens held back as the server holds it (``schemafill.contract.stopping``)."""
    rng = random.Random(1)
    token_ids = smol_tokenizer(TEXT, add_special_tokens=False).input_ids
    for _ in range(20):
        s, deltas, n = MessageStream(ids), [], 0
        while n < len(token_ids):
            n = min(len(token_ids), n + rng.randint(1, 6))  # one round's accepted tokens
            text = smol_tokenizer.decode(token_ids[:n], skip_special_tokens=True).rstrip("\ufffd")
            deltas += s.feed(text)
        deltas += s.feed(smol_tokenizer.decode(token_ids, skip_special_tokens=True), final=True)
        assert assemble(deltas) == message(TEXT, ids)
