"""The packer and the forecast on literal cases."""

from __future__ import annotations

from infer.slots.forecast import call_plan, forecast_groups, rank_tools, words
from infer.slots.packer import CallPlan, propose
from schemafill.contract.parser import parse_prefix
from schemafill.contract.response_format import object_format
from schemafill.contract.toolcall import ToolRequest

WEATHER = CallPlan("get_weather", ("city", "unit"), ("city", "unit", "days"), {"city": '"Paris"', "unit": '"C"'})
TIME = CallPlan("get_time", ("tz",), ("tz",), {})


def p(text, plans, **kw):
    return propose(text, parse_prefix(text), plans, **kw)


def test_from_nothing_to_the_first_unprepared_value():
    assert p("", [WEATHER, TIME]) == ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", '
                                      '"unit": "C"}}, {"name": "get_time", "arguments": {"tz": ')


def test_inside_a_value_the_prepared_rest_and_bridges_follow():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa'
    assert p(text, [WEATHER]) == 'ris", "unit": "C"}}]}'
    # a value that disagrees with the prepared one: nothing to propose
    assert p('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lo', [WEATHER]) == ""


def test_realized_values_are_kept_and_unforeseen_keys_completed():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "da'
    assert p(text, [WEATHER]) == 'ys": '  # an optional key of the schema, then an unknown value
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"'
    assert p(text, [WEATHER, TIME]) == ', "unit": "C"}}, {"name": "get_time", "arguments": {"tz": '
    assert p(text, [WEATHER, TIME], cross_calls=False) == ', "unit": "C"}}'


def test_past_the_predicted_keys_a_comma_leads_to_the_schemas_next_key():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F",'
    assert p(text, [WEATHER]) == ' "days": '  # the optional key after the last one written, in schema order
    assert p(text + ' "days": 3,', [WEATHER]) == ""  # nothing after the schema's last key
    structured = object_format("get_weather")  # a structured output: the object alone, the same keys
    text = '{"city": "Rome", "unit": "F",'
    assert propose(text, parse_prefix(text, structured), [WEATHER], fmt=structured) == ' "days": '


def test_between_calls_and_after_the_last():
    text = '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert p(text, [TIME, WEATHER]).startswith(', {"name": "get_weather", "arguments": {"city": "Paris"')
    assert p(text, [TIME]) == "]}"
    assert p(text + "]}", [TIME]) == ""  # closed


def test_a_provisional_value_ends_the_chain_and_must_extend_mains_text():
    plans = [CallPlan("get_weather", ("city", "unit"), ("city", "unit"), {"unit": '"C"'}),
             CallPlan("get_time", ("tz",), ("tz",), {})]
    ahead = {(0, "city"): '"Lon', (1, "tz"): '"UT'}
    head = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": '
    assert p("", plans, provisional=ahead) == head + '"Lon'  # stops after the provisional prefix, never past it
    assert p(head + '"L', plans, provisional=ahead) == 'on'
    assert p(head + '"Lon', plans, provisional=ahead) == ""  # MAIN caught up: nothing left to offer
    assert p(head + '"Par', plans, provisional=ahead) == ""  # MAIN wrote something else
    # a provisional value of a later call follows the prepared rest of this one
    done = head + '"London"'
    assert p(done, plans, provisional=ahead) == ', "unit": "C"}}, {"name": "get_time", "arguments": {"tz": "UT'
    assert p(done, plans, cross_calls=False, provisional=ahead) == ', "unit": "C"}}'


def test_off_format_text_gets_no_proposal():
    assert p('{"tool_calls": [{"name":"get_weather"', [WEATHER]) == ""  # other spacing inside the call
    # spacing outside the current call does not matter: the call is rebuilt from its "{"
    assert p('{"tool_calls":[{"name": "get_weather"', [WEATHER]).startswith(', "arguments": {"city": "Paris"')
    assert p('{"tool_calls": [{"name": "get_time", "arguments": {', [WEATHER]) == ""  # plan not rebound


def test_words_split_identifiers():
    assert words("getWeather_forCity.v2-beta") == ["get", "weather", "for", "city", "v", "2", "beta"]


def _req(tools, text):
    return ToolRequest(id="r", messages=[{"role": "user", "content": text}],
                       tools=[{"type": "function", "function": f} for f in tools])


def test_bm25_ranking_groups_and_slots():
    tools = [
        {"name": "send_email", "description": "Send an email", "parameters": {"type": "object", "properties": {
            "to": {"type": "string"}}, "required": ["to"]}},
        {"name": "get_weather", "description": "Weather forecast for a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "description": "city name"},
                                             "unit": {"type": "string"}}, "required": ["city"]}},
        {"name": "noop", "description": "", "parameters": {"type": "object", "properties": {}}},
    ]
    req = _req(tools, "What is the weather in Paris? Which city is warmer?")
    ranking = rank_tools(req)
    assert ranking[0] == 1 and ranking[1:] == [0, 2]  # zero scores keep catalog order
    assert forecast_groups(ranking, 5) == [1, 0, 2, 1, 0]
    plans = [call_plan(tools[g]) for g in forecast_groups(ranking, 3)]
    assert [(p.tool, p.keys, p.schema_keys) for p in plans] == [
        ("get_weather", ("city",), ("city", "unit")), ("send_email", ("to",), ("to",)), ("noop", (), ())]
    assert call_plan({"name": "f", "parameters": {"properties": {"a": {}, "b": {}}}}).keys == ("a", "b")  # none required
    assert rank_tools(_req(tools[:1], "anything")) == [0]


def test_each_proposed_character_and_token_knows_what_it_is(smol_tokenizer):
    from infer.rounds.candidates import Candidates
    from infer.slots.packer import BRIDGE, END, PROVISIONAL, VALUE, propose_tagged, token_kinds
    from schemafill.contract.response_format import continuation_ids

    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa'
    suffix, kinds, *_ = propose_tagged(text, parse_prefix(text), [WEATHER], provisional={(0, "days"): "3"})
    assert suffix == 'ris", "unit": "C"}}]}' and len(kinds) == len(suffix)
    assert "".join("v" if k == VALUE else "b" for k in kinds) == "vvvvbbbbbbbbbbvvvbbbb"
    _, kinds, *_ = propose_tagged('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "da',
                              parse_prefix('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "da'),
                              [WEATHER], provisional={(0, "days"): "3"})
    assert kinds[-1] == PROVISIONAL and set(kinds[:-1]) == {BRIDGE}
    # tokens: the riskiest kind among the characters each covers
    committed = smol_tokenizer(text, add_special_tokens=False).input_ids
    ids = continuation_ids(smol_tokenizer, committed, text, suffix)
    tags = token_kinds(smol_tokenizer, committed, text, suffix, propose_tagged(text, parse_prefix(text), [WEATHER])[1], ids)
    pieces = [smol_tokenizer.decode([t]) for t in ids]
    assert len(tags) == len(ids) and tags[0] == VALUE and tags[-1] == END  # the list's close after the last call
    assert [t for t, piece in zip(tags, pieces) if "C" in piece] == [VALUE]
    chain = Candidates.tagged_chain(ids, tags)
    assert chain.sources[0] == "value:1" and chain.sources[-1].startswith("end:")


def test_hermes3_writes_each_name_after_its_arguments():
    from schemafill.contract.response_format import HERMES3

    def p3(text, plans, **kw):
        return propose(text, parse_prefix(text, HERMES3), plans, fmt=HERMES3, **kw)

    blocks = "\n</tool_call>\n<tool_call>\n"
    head = '<tool_call>\n{"arguments": {'
    assert p3("", [WEATHER, TIME]) == (head + '"city": "Paris", "unit": "C"}, "name": "get_weather"}' + blocks
                                       + '{"arguments": {"tz": ')
    # mid-arguments, before the name: the plan's tool closes the call
    assert p3(head + '"city": "Pa', [WEATHER, TIME]) == ('ris", "unit": "C"}, "name": "get_weather"}' + blocks
                                                         + '{"arguments": {"tz": ')
    assert p3(head + '"city": "Pa', [WEATHER], cross_calls=False) == 'ris", "unit": "C"}, "name": "get_weather"}'
    assert p3(head + '"da', [WEATHER]) == 'ys": '  # an unforeseen key of the schema
    # after the last argument: the name, the bridge, the next plan's call
    done = head + '"city": "Paris", "unit": "C"'
    assert p3(done, [WEATHER, TIME]) == '}, "name": "get_weather"}' + blocks + '{"arguments": {"tz": '
    assert p3(done, [WEATHER]) == '}, "name": "get_weather"}\n</tool_call>'  # the last call: the block closes
    # MAIN closed the arguments before the predicted keys ran out: the name follows its fields
    assert p3(head + '"city": "Rome"}', [WEATHER, TIME]) == (', "name": "get_weather"}' + blocks
                                                            + '{"arguments": {"tz": ')
    assert p3(head + '}', [WEATHER]) == ', "name": "get_weather"}\n</tool_call>'
    assert p3(head + '"city": "Rome"}, "name": "get_w', [WEATHER]) == 'eather"}\n</tool_call>'
    assert p3(head + '"city": "Rome"}, "name": "get_t', [WEATHER]) == ""  # another tool's name: not this plan
    between = head + '"tz": "UTC"}, "name": "get_time"}\n</tool_call>'
    assert p3(between, [TIME, WEATHER]) == ('\n<tool_call>\n{"arguments": {"city": "Paris", "unit": "C"}, '
                                            '"name": "get_weather"}\n</tool_call>')
    assert p3(between, [TIME]) == ""  # hermes3 ends with EOS: nothing after the last block
    # the name-first text is off format here
    assert p3('<tool_call>\n{"name": "get_weather", "arguments": {', [WEATHER]) == ""


def test_where_an_open_value_may_end():
    from infer.slots.packer import CLOSE_NUMBER, CLOSE_STRING, closing

    assert closing('"Par') == ('"', CLOSE_STRING)
    assert closing('"a\\\\') == ('"', CLOSE_STRING)  # an escaped backslash: the string may end
    for literal in ('"', '"a\\', '-', '3.', '1e', '1e-', 'tr', '[1', '{"a": 1'):
        assert closing(literal) is None, literal  # cannot end here, or is no string or number
    assert closing('30') == closing('-2.5') == ("", CLOSE_NUMBER)


def test_guessed_ends_close_mains_value_and_provisional_ones_and_go_on():
    from infer.slots.packer import CLOSE_NUMBER, CLOSE_STRING, END, NEXT, PROVISIONAL, propose_tagged

    plans = [CallPlan("get_weather", ("city", "days"), ("city", "days"), {}), TIME]
    head = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": '
    # MAIN's own string, nothing prepared: without the guess nothing is proposed
    assert p(head + '"Lo', plans) == ""
    suffix, kinds, *_ = propose_tagged(head + '"Lo', parse_prefix(head + '"Lo'), plans, close=True)
    assert suffix == '", "days": ' and kinds[0] == CLOSE_STRING and set(kinds[1:]) == {"bridge"}
    # a number: its end is the structure after it, whose first character carries the guess
    text = head + '"Lo", "days": 3'
    suffix, kinds, *_ = propose_tagged(text, parse_prefix(text), plans, close=True)
    assert suffix == '}}, {"name": "get_time", "arguments": {"tz": ' and kinds[0] == CLOSE_NUMBER
    assert kinds[2:4] == [NEXT, NEXT] and kinds[-1] == "bridge"
    # provisional values are closed where they stop, and the chain runs on to the next unknown
    ahead = {(0, "days"): "1", (1, "tz"): '"UT'}
    text = head + '"London"'
    assert p(text, plans, provisional=ahead) == ', "days": 1'
    suffix, kinds, *_ = propose_tagged(text, parse_prefix(text), plans, provisional=ahead, close=True)
    assert suffix == ', "days": 1}}, {"name": "get_time", "arguments": {"tz": "UT"}}]}'
    tags = dict(bridge="b", next="n", end="e", provisional="p", close_number="c", close_string="c")
    header = '{"name": "get_time", "arguments": {"tz": '
    assert "".join(map(tags.get, kinds)) == "b" * 10 + "p" + "cb" + "nn" + "b" * len(header) + "ppp" + "cbb" + "ee"
    assert kinds[-2:] == [END, END]
    # MAIN ran past a provisional value: its own text is what may end
    assert p(head + '"London", "days": 12', plans, provisional=ahead, close=True).startswith("}}, {")
    # a value that cannot end yet, or a literal: nothing guessed
    assert p(head + '"', plans, close=True) == ""
    assert p(head + '"Lo", "days": 1.', plans, close=True) == ""


def test_arguments_closed_before_the_predicted_keys_go_on_to_the_next_call():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}'
    assert p(text, [WEATHER, TIME]) == '}, {"name": "get_time", "arguments": {"tz": '
    assert p(text, [WEATHER]) == "}]}"


def test_a_value_nobody_prepared_starts_as_its_schema_says():
    from infer.slots.forecast import value_kind
    from infer.slots.packer import ANY_VALUE, OPEN, propose_tagged

    assert [value_kind(s) for s in ({"type": "integer"}, {"type": "float"}, {"type": "String"}, {"type": "dict"},
                                    {"type": "array", "items": {"type": "string"}}, {"type": "tuple"},
                                    {"type": ["string", "null"]}, {}, "string")] == \
        ["number", "number", "string", "object", "array_string", "array", "", "", ""]
    fn = {"name": "book", "parameters": {"type": "object", "required": ["n", "city", "tags", "ok", "x"], "properties": {
        "n": {"type": "integer"}, "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"}, "x": {}}}}
    plan = call_plan(fn)
    head = '{"tool_calls": [{"name": "book", "arguments": {'
    cases = [(head + '"n', '": ', "15"), (head + '"n": 3, "city', '": "', "aA"),
             (head + '"n": 3, "city": "Rome", "tags', '": ["', "aA"),
             (head + '"n": 3, "city": "Rome", "tags": [], "ok', '": ', "tf"),
             (head + '"n": 3, "city": "Rome", "tags": [], "ok": true, "x', '": ', ANY_VALUE)]
    for text, suffix, then in cases:
        packed = propose_tagged(text, parse_prefix(text), [plan])
        assert (packed.text, packed.then) == (suffix, then), text
    packed = propose_tagged(head + '"n": 3, "city', parse_prefix(head + '"n": 3, "city'), [plan])
    assert packed.kinds[-1] == OPEN and set(packed.kinds[:-1]) == {"bridge"}
    # MAIN has begun the value itself: the opening is behind it, nothing is proposed (no guessed end)
    assert p(head + '"n": 3, "city": "Ro', [plan]) == ""
    # a plan without kinds (a schema that says none) stops before the value, as any value may follow
    bare = CallPlan("book", plan.keys, plan.schema_keys, {})
    assert propose_tagged(head + '"n', parse_prefix(head + '"n'), [bare]) == \
        ('": ', ["bridge"] * 3, ANY_VALUE, (0, "n"))


def test_the_tokens_kept_before_an_unknown_value_are_the_ones_it_cannot_merge_with(smol_tokenizer):
    from schemafill.contract.response_format import stable_continuation_ids

    def kept(text, suffix, then):
        committed = smol_tokenizer(text, add_special_tokens=False).input_ids
        return smol_tokenizer.convert_ids_to_tokens(stable_continuation_ids(smol_tokenizer, committed, text, suffix,
                                                                            then))

    # this tokenizer writes the space before a digit as a token of its own, and merges it
    # with a quote, a bracket or a word
    assert kept('{"n', '": ', "15") == ['":', "Ġ"]
    assert kept('{"city', '": "', "aA") == ['":', 'Ġ"']
    assert kept('{"tags', '": ["', "aA") == ['":', 'Ġ["']
    assert kept('{"ok', '": ', "tf") == ['":']  # " true" is one token
    assert kept('{"x', '": ', '"1[{tn') == ['":']  # anything may follow: the space waits for it
    assert kept('{"x', '": ', "") == ['":']  # nothing said of what follows: a trailing space is dropped


def test_a_guessed_value_is_written_as_if_prepared_its_end_tagged_apart():
    from infer.slots.packer import ANY_VALUE, GUESS, GUESS_END, propose_tagged

    plans = [CallPlan("get_weather", ("city", "days"), ("city", "days"), {}, {"city": "string", "days": "number"}),
             TIME]
    head = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": '
    # the chain stops before the value nobody prepared, and names it
    packed = propose_tagged(head + '"Rome", "da', parse_prefix(head + '"Rome", "da'), plans)
    assert (packed.text, packed.then, packed.slot) == ('ys": ', "15", (0, "days"))
    # a number guessed: written, then the structure after it, whose first character is its end
    text = head + '"Rome", "days": '
    suffix, kinds, then, slot = propose_tagged(text, parse_prefix(text), plans, guessed={(0, "days"): "12"})
    assert suffix == '12}}, {"name": "get_time", "arguments": {"tz": ' and (then, slot) == (ANY_VALUE, (1, "tz"))
    assert kinds[:3] == [GUESS, GUESS, GUESS_END] and GUESS not in kinds[3:]
    # a string guessed: its closing quote is its end
    suffix, kinds, _, slot = propose_tagged(head, parse_prefix(head), plans, guessed={(0, "city"): '"Rome"'})
    assert suffix == '"Rome", "days": ' and kinds[:6] == [GUESS] * 5 + [GUESS_END] and slot == (0, "days")
    # the value MAIN is writing goes on as a guess only where the guess starts with what it wrote
    text = head + '"Rome", "days": 1'
    assert propose_tagged(text, parse_prefix(text), plans, guessed={(0, "days"): "12"}).text.startswith("2}}")
    assert propose_tagged(text, parse_prefix(text), plans, guessed={(0, "days"): "30"}).text == ""
    # with guessed ends on, a guess that does not fit MAIN's value leaves that guess to close it
    assert propose_tagged(text, parse_prefix(text), plans, close=True, guessed={(0, "days"): "30"}).text \
        .startswith("}}, {")


def test_the_forecast_plan_holds_its_schemas_choices():
    fn = {"name": "f", "parameters": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["C", "F"]}, "exact": {"type": "boolean"}, "n": {"type": "integer"}}}}
    assert call_plan(fn).choices == {"unit": ('"C"', '"F"'), "exact": ("true", "false")}
