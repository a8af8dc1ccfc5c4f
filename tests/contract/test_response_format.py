"""The response formats on literal cases: each format's text, its parse (the parser's view of
structure must not depend on the wrapper), the packer's bridges, the stopping rule, prompts."""

from __future__ import annotations

import pytest

from infer.slots.packer import CallPlan, propose
from schemafill.contract.parser import parse_prefix, response_layout
from schemafill.contract.prompt import render_plain
from schemafill.contract.response_format import FORMATS, HERMES, HERMES3, JSON, MISTRAL
from schemafill.contract.stopping import ResponseStop
from schemafill.contract.toolcall import ToolCall, ToolRequest, parse_response, serialize_calls

CALLS = [{"name": "get_weather", "arguments": {"city": "Paris, \"FR\"", "days": 3}},
         {"name": "book", "arguments": {"when": {"day": "mon", "slots": [1, 2]}, "ok": True}}]
WEATHER = CallPlan("get_weather", ("city", "unit"), ("city", "unit", "days"), {"city": '"Paris"', "unit": '"C"'})
TIME = CallPlan("get_time", ("tz",), ("tz",), {})


def test_each_format_writes_the_same_call_objects_in_its_own_wrapper():
    assert JSON.serialize(CALLS[:1]) == \
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3}}]}'
    assert HERMES.serialize(CALLS) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "book", "arguments": {"when": {"day": "mon", "slots": [1, 2]}, "ok": true}}\n'
        '</tool_call>')
    assert HERMES3.serialize(CALLS[:1]) == \
        '<tool_call>\n{"arguments": {"city": "Paris, \\"FR\\"", "days": 3}, "name": "get_weather"}\n</tool_call>'
    assert MISTRAL.serialize(CALLS) == (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3}}, '
        '{"name": "book", "arguments": {"when": {"day": "mon", "slots": [1, 2]}, "ok": true}}]')
    assert JSON.serialize([]) == '{"tool_calls": []}' and HERMES.serialize([]) == HERMES.empty
    assert MISTRAL.serialize([]) == MISTRAL.empty  # a reply in words
    for fmt in FORMATS.values():
        assert fmt.parse(fmt.serialize(CALLS)) == CALLS and FORMATS[fmt.name] is fmt
        head = '{"name": "f", "arguments": {' if fmt.name_first else '{"arguments": {'
        assert fmt.field_prefix("f", "k") == fmt.header + head + '"k":'
        assert [(c.name, c.arguments, c.closed) for c in fmt.call_spans(fmt.serialize(CALLS))] == \
            [(c["name"], JSON.serialize([c])[len('{"tool_calls": [{"name": "') + len(c["name"]) + 16:-3], True)
             for c in CALLS]


def test_hermes_parse_is_strict_about_what_surrounds_the_blocks():
    block = HERMES.serialize(CALLS[:1])
    assert HERMES.parse("I can't do that.") == []  # a reply in words calls nothing
    assert HERMES.is_calls("\n") is None and HERMES.is_calls("\n<tool_call>") is True  # as the base model writes
    assert HERMES.parse(block + "\n\n" + block) == CALLS[:1] * 2  # blocks on separate lines, any whitespace
    assert HERMES.parse("Sure! " + block) is None  # text around a call
    assert HERMES.parse(block[:-3]) is None  # an unclosed block
    assert HERMES.parse("<tool_call>\n{not json}\n</tool_call>") is None
    calls = parse_response(block, HERMES)
    assert calls == [ToolCall("get_weather", {"city": "Paris, \"FR\"", "days": 3})]
    assert serialize_calls(calls, HERMES) == block and parse_response(block) is None  # not a json-format response


def test_mistral_parse_reads_the_list_after_its_marker():
    text = MISTRAL.serialize(CALLS)
    assert MISTRAL.parse("I can't do that.") == []  # a reply in words calls nothing
    assert MISTRAL.parse(" " + text.replace("] [", "][") + "\n") == CALLS  # any whitespace around the list
    assert MISTRAL.parse("Sure! " + text) is None and MISTRAL.parse(text[:-1]) is None
    assert MISTRAL.parse('[TOOL_CALLS] {"name": "f"}') is None  # not a list
    assert MISTRAL.is_calls("[TOOL") is None and MISTRAL.is_calls(text) and MISTRAL.is_calls("[{") is False
    for i in range(len(text)):  # every prefix parses, and only the last "]" closes the response
        state = parse_prefix(text[:i], MISTRAL)
        assert state.error is None and not state.closed, (i, state.error)
    assert parse_prefix(text, MISTRAL).closed
    for bad, where in (("Hello", "'[TOOL_CALLS]', got 'H'"), ("[TOOL_CALLS] {", "expected '[', got '{'"),
                       (text + " x", "text after the closed outer object"), ("[TOOL_CALS]", "'[TOOL_CALLS]'")):
        assert where in parse_prefix(bad, MISTRAL).error, bad


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL], ids=lambda f: f.name)
def test_the_parser_sees_the_same_structure_through_either_wrapper(fmt):
    """Cut the json text at every character of each call object; the other format's text cut at
    the same place of the same call parses to the same state, offsets moved by the wrappers'
    difference."""
    jtext, htext = JSON.serialize(CALLS), fmt.serialize(CALLS)
    jcalls = [c.spans for c in response_layout(jtext)]
    hcalls = [c.spans for c in response_layout(htext, fmt)]
    assert [[jtext[a:e] for _, a, e in spans] for spans in jcalls] == \
        [[htext[a:e] for _, a, e in spans] for spans in hcalls]
    j_starts = [jtext.index('{"name"', i) for i in (0, jtext.index("}}, ") + 3)]
    h_starts = [htext.index('{"name"', i) for i in (0, htext.index("}}") + 2)]
    ends = (jtext.index("}}, ") + 2, len(jtext) - 2)  # each call object's closing brace, included
    for j_start, h_start, end in zip(j_starts, h_starts, ends):
        shift = h_start - j_start
        moved = lambda v: None if v is None else v + shift  # noqa: E731
        for at in range(j_start, end + 1):
            js, hs = parse_prefix(jtext[:at]), parse_prefix(htext[:at + shift], fmt)
            assert hs.error is None and js.error is None
            assert (hs.call_index, hs.tool_name, hs.field, hs.in_key, hs.in_value, hs.value_type,
                    hs.fields_done) == \
                (js.call_index, js.tool_name, js.field, js.in_key, js.in_value, js.value_type, js.fields_done), at
            assert (hs.value_start, hs.call_start) == (moved(js.value_start), moved(js.call_start))
            assert [(k, a + shift, e + shift) for k, a, e in js.spans] == list(hs.spans)


def test_valid_calls_are_checked_against_the_catalog_in_either_format():
    from schemafill.runtime.grammar import valid_response

    catalog = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}]
    for fmt in FORMATS.values():
        assert valid_response(fmt.serialize(CALLS[:1]), catalog, fmt=fmt)
        assert not valid_response(fmt.serialize(CALLS), catalog, fmt=fmt)  # "book" is not in the catalog
        assert not valid_response(fmt.serialize(CALLS[:1])[:-3], catalog, fmt=fmt)  # cut short
    assert not valid_response(HERMES.serialize(CALLS[:1]), catalog)  # read as json, hermes is not valid
    # read as hermes, mistral's text is a reply in words: valid, but no call where one is required
    assert valid_response(MISTRAL.serialize(CALLS[:1]), catalog, fmt=HERMES)
    assert not valid_response(MISTRAL.serialize(CALLS[:1]), catalog, min_calls=1, fmt=HERMES)
    assert valid_response(HERMES.serialize(CALLS[:1]), catalog, min_calls=1, fmt=HERMES)


def test_hermes_prefixes_never_fail_and_the_state_between_blocks():
    text = HERMES.serialize(CALLS)
    for i in range(len(text) + 1):
        state = parse_prefix(text[:i], HERMES)
        assert state.error is None and not state.closed, (i, state.error)  # EOS, not the text, ends it
    first = text[:text.index("</tool_call>") + len("</tool_call>")]
    state = parse_prefix(first + "\n", HERMES)
    assert (state.call_index, state.calls_started, state.last_call_end) == (None, 1, first.rindex("}") + 1)
    cut = first.split("\n</tool_call>")[0][:-2] + ","  # a number closes at the character after it
    assert next(cut[a:e] for k, a, e in parse_prefix(cut, HERMES).spans if k == "days") == "3"
    for bad, where in (("Hello", "'<tool_call>', got 'H'"), (first + " x", "'<tool_call>', got 'x'"),
                       ("<tool_call>\n{}\n</tool_cal!", "'</tool_call>'"), ("<tool_call>\n{} {", "'</tool_call>'")):
        assert where in parse_prefix(bad, HERMES).error, bad


def p(text, plans, fmt, **kw):
    return propose(text, parse_prefix(text, fmt), plans, fmt=fmt, **kw)


def test_the_packer_bridges_fields_and_calls_in_hermes():
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    assert p("", [WEATHER, TIME], HERMES) == \
        f'<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{"tz": '
    inside = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert p(inside, [WEATHER], HERMES) == 'ris", "unit": "C"}}\n</tool_call>'
    assert p(inside, [WEATHER, TIME], HERMES, cross_calls=False) == 'ris", "unit": "C"}}'
    done = f"<tool_call>\n{call}\n</tool_call>"
    # between blocks, wherever MAIN stopped in the bridge: the next block, or nothing after the last
    assert p(done, [WEATHER, TIME], HERMES) == '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
    assert p(done + "\n<tool", [WEATHER, TIME], HERMES) == '_call>\n{"name": "get_time", "arguments": {"tz": '
    assert p(done, [WEATHER], HERMES) == ""
    assert p("Sorry, ", [WEATHER], HERMES) == ""  # a reply in words: nothing to pack


def test_the_stopping_rule_of_each_format(smol_tokenizer):
    eos = smol_tokenizer.eos_token_id
    for fmt, reason in ((JSON, "closed"), (HERMES, None), (HERMES3, None), (MISTRAL, "closed")):
        stop = ResponseStop(smol_tokenizer, {eos}, 500, fmt=fmt)
        ids = smol_tokenizer(fmt.serialize(CALLS), add_special_tokens=False).input_ids
        assert stop.push(ids + [eos]) == len(ids) + (reason is None)
        assert stop.reason == (reason or "eos")
        assert fmt.complete(stop.text, stop.reason)
        assert not fmt.complete(fmt.serialize(CALLS)[:-4], "eos")


def test_prompts_ask_for_the_targets_format():
    req = ToolRequest(id="r", messages=[{"role": "user", "content": "Weather in Paris?"}],
                      tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
                          "type": "object", "properties": {"city": {"type": "string"}}}}}])
    plain, hermes = render_plain(req), render_plain(req, HERMES)
    assert JSON.template in plain and "<tool_call>" not in plain and plain.count(JSON.empty) == 1
    assert HERMES.template in hermes and '{"tool_calls"' not in hermes and hermes.count(HERMES.empty) == 1
    assert plain.endswith("User: Weather in Paris?\n\nResponse:\n") and hermes.endswith("Response:\n")
    for fmt in (HERMES3, MISTRAL):
        text = render_plain(req, fmt)
        assert fmt.template in text and text.count(fmt.empty) == 1 and '{"tool_calls"' not in text
    assert '{"arguments": {' in render_plain(req, HERMES3) and "[TOOL_CALLS] [" in render_plain(req, MISTRAL)


def test_a_marker_held_as_a_special_token_stays_in_the_response_text(marker_tokenizer):
    """Mistral's ``[TOOL_CALLS]`` is a control token: a plain decode drops it (so would the
    parser's view, and no call would ever be read); the format's decode keeps it, drops the
    other special tokens as before, and the stopping rule closes on the list's bracket."""
    tok, eos = marker_tokenizer, marker_tokenizer.eos_token_id
    text = MISTRAL.serialize(CALLS)
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("[TOOL_CALLS]") == 49152  # one token, as Mistral writes it
    assert tok.decode(ids, skip_special_tokens=True) == text[len("[TOOL_CALLS]"):]
    assert MISTRAL.decode(tok, ids + [eos]) == text and JSON.decode(tok, ids) == text[len("[TOOL_CALLS]"):]
    stop = ResponseStop(tok, {eos}, 500, fmt=MISTRAL)
    assert stop.push(ids + [eos]) == len(ids) and stop.reason == "closed" and stop.text == text
    assert MISTRAL.parse(stop.text) == CALLS
    # the packer extends the text after the marker token (a plain decode would not match the text)
    from schemafill.contract.response_format import continuation_ids

    for cut in (1, 3):
        seen = MISTRAL.decode(tok, ids[:cut])
        assert seen.startswith("[TOOL_CALLS]")
        assert continuation_ids(tok, ids[:cut], seen, text[len(seen):], MISTRAL) == ids[cut:]


@pytest.mark.parametrize("fmt", [JSON, HERMES])
def test_a_suffix_is_tokenised_as_the_whole_response_tokenises_it(smol_tokenizer, fmt):
    from schemafill.contract.response_format import CONTINUATION_TAIL, continuation_ids

    tok = smol_tokenizer
    calls = CALLS + [{"name": "note", "arguments": {"text": "café €5 — naïve 東京, 1e-3 and  two  spaces", "n": -12.5}}]
    response = fmt.serialize(calls)
    ids = tok(response, add_special_tokens=False).input_ids
    assert len(ids) > 3 * CONTINUATION_TAIL
    checked = 0
    for cut in range(1, len(ids)):
        text = fmt.decode(tok, ids[:cut])
        if text.endswith("\ufffd"):  # a split character: the parsed text lags, nothing is packed
            assert continuation_ids(tok, ids[:cut], text[:-1], response[len(text) - 1:], fmt) == []
            continue
        # the canonical tokens of the response after the cut, from the tail's tokens or the whole text's
        assert continuation_ids(tok, ids[:cut], text, response[len(text):], fmt) == ids[cut:], cut
        checked += 1
    assert checked > len(ids) // 2
    # a response whose last words the target wrote in its own tokens (" Se|attle", one token
    # " Seattle" canonically): its tokens do not come back, so no merge across them is assumed
    # and the suffix goes alone (the whole text would merge "attle|s" into "attles")
    words = tok(" Se", add_special_tokens=False).input_ids + tok("attle", add_special_tokens=False).input_ids
    own = ids[:2 * CONTINUATION_TAIL] + words
    text, suffix = fmt.decode(tok, own), 's", "n": 1}'
    alone = tok(suffix, add_special_tokens=False).input_ids
    assert tok(text + suffix, add_special_tokens=False).input_ids[len(own) - 1:] != alone
    assert continuation_ids(tok, own, text, suffix, fmt) == alone
