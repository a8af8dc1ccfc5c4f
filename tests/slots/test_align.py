"""Alignment of the forecast with what MAIN realized, on small literal cases."""

from __future__ import annotations

from infer.slots.align import current_call, is_stale, rebind, rebind_by_keys, slots_to_open, written_keys
from infer.slots.packer import CallPlan
from schemafill.contract.parser import parse_prefix

FUNCTIONS = {"a": {"name": "a", "parameters": {"properties": {"x": {}, "y": {}}, "required": ["x"]}},
             "b": {"name": "b", "parameters": {"properties": {"q": {}}}}}
# name-last formats: keys written before any name (c shares "x" with a, d shares "q" with b)
KEYED = FUNCTIONS | {"c": {"name": "c", "parameters": {"properties": {"x": {}, "z": {}}}},
                     "d": {"name": "d", "parameters": {"properties": {"q": {}, "qq": {}}}}}


def plans(*tools: str) -> list[CallPlan]:
    keys = {"a": (("x",), ("x", "y")), "b": (("q",), ("q",)), "c": (("x", "z"), ("x", "z")),
            "d": (("q", "qq"), ("q", "qq"))}
    return [CallPlan(t, *keys[t], {}) for t in tools]


def test_current_call_is_the_open_one_or_the_next():
    assert current_call(parse_prefix("")) == 0
    assert current_call(parse_prefix('{"tool_calls": [{"name": "a", "arguments": {"x": 1}}')) == 1
    assert current_call(parse_prefix('{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b"')) == 1


def test_rebind_swaps_in_a_later_group_of_the_realized_tool():
    p = plans("a", "b", "a")
    p[1].values["q"] = "7"
    assert rebind(p, 0, "b", FUNCTIONS) == {0: 1, 1: 0}  # branches of both calls move with their plans
    assert [x.tool for x in p] == ["b", "a", "a"] and p[0].values == {"q": "7"}


def test_rebind_makes_a_fresh_plan_or_extends_or_leaves_alone():
    p = plans("a", "a")
    p[0].values["x"] = "1"
    assert rebind(p, 0, "b", FUNCTIONS) == {}
    assert [x.tool for x in p] == ["b", "a"] and p[0].values == {} and p[0].keys == ("q",)
    assert rebind(p, 3, "a", FUNCTIONS) == {} and [x.tool for x in p] == ["b", "a", "a", "a"]
    before = [x.tool for x in p]
    assert rebind(p, 1, "nope", FUNCTIONS) == {} and [x.tool for x in p] == before  # unknown tool
    assert rebind(p, 1, "a", FUNCTIONS) == {} and [x.tool for x in p] == before  # already right


def test_stale_branches():
    p = plans("a", "b")
    assert not is_stale(1, "b", "q", current=0, realized=set(), plans=p)
    assert is_stale(0, "a", "x", current=1, realized=set(), plans=p)  # its call is over
    assert is_stale(0, "a", "x", current=0, realized={(0, "x")}, plans=p)  # MAIN wrote the field
    assert is_stale(1, "a", "x", current=0, realized=set(), plans=p)  # the plan changed tool
    assert is_stale(2, "a", "x", current=0, realized=set(), plans=p)  # no such call any more


def test_slots_open_for_this_call_and_the_next_predicted_first():
    p = plans("a", "b", "a")
    assert slots_to_open(p, 0, optional=False) == [(0, "x"), (1, "q")]
    assert slots_to_open(p, 0, optional=True) == [(0, "x"), (1, "q"), (0, "y")]
    assert slots_to_open(p, 2, optional=True) == [(2, "x"), (2, "y")]
    assert slots_to_open(p, 3, optional=True) == []


def test_written_keys_of_an_args_first_call():
    from schemafill.contract.response_format import HERMES3

    def keys(text):
        return written_keys(text, parse_prefix(text, HERMES3))

    head = '<tool_call>\n{"arguments": {'
    assert keys(head) == ((), "")
    assert keys(head + '"x": 1, "z": "a') == (("x", "z"), "")  # closed values, then the open one's key
    assert keys(head + '"x": 1, "z') == (("x",), "z")  # a key being typed
    assert keys(head + '"x": 1}, "name": "') == (("x",), "")  # after the arguments
    assert keys(head + '"x": 1}, "name": "c"}\n</tool_call>\n<tool_call>\n{') == ((), "")  # the next call


def test_rebind_by_keys_follows_the_keys_until_the_name():
    p = plans("a", "b")
    assert rebind_by_keys(p, 0, ("x",), KEYED) == {} and [x.tool for x in p] == ["a", "b"]  # a holds x: kept
    assert rebind_by_keys(p, 0, ("x", "y"), KEYED, partial="") == {} and p[0].tool == "a"
    assert rebind_by_keys(p, 0, (), KEYED, partial="y") == {} and p[0].tool == "a"  # a key being typed that a has
    p[1].values["q"] = "7"
    assert rebind_by_keys(p, 0, (), KEYED, partial="q") == {0: 1, 1: 0}  # a later group holds it: swapped
    assert [x.tool for x in p] == ["b", "a"] and p[0].values == {"q": "7"}


def test_rebind_by_keys_prefers_a_later_group_then_one_catalog_tool():
    p = plans("b", "d", "c")
    assert rebind_by_keys(p, 0, ("x",), KEYED) == {0: 2, 2: 0}  # c holds x (so does a): the forecast's group wins
    assert [x.tool for x in p] == ["c", "d", "b"]
    p = plans("b", "b")
    p[0].values.update(q="1")
    assert rebind_by_keys(p, 0, ("q", "qq"), KEYED) == {}  # only d (a catalog tool) holds both
    assert [x.tool for x in p] == ["d", "b"] and p[0].keys == ("q", "qq")
    assert p[0].values == {"q": "1"}  # a shared key's prepared value stays: its SIDE context named no tool
    p = plans("b")
    p[0].values.update(q="1")
    assert rebind_by_keys(p, 0, ("x",), KEYED) == {} and [x.tool for x in p] == ["b"]  # a and c hold x: alone
    assert rebind_by_keys(p, 0, ("w",), KEYED) == {} and [x.tool for x in p] == ["b"]  # none does: alone
    assert rebind_by_keys(p, 0, ("x", "z"), KEYED) == {} and [x.tool for x in p] == ["c"]
    assert p[0].values == {}  # c has no q
    # more calls than groups: a plan is added once the keys fit exactly one tool
    assert rebind_by_keys(p, 2, ("q",), KEYED) == {} and len(p) == 1  # b and d: not yet
    assert rebind_by_keys(p, 2, ("q",), KEYED, partial="qq") == {} and [x.tool for x in p] == ["c", "d", "d"]
    one = {"b": KEYED["b"]}
    p = plans("b")
    assert rebind_by_keys(p, 1, (), one) == {} and [x.tool for x in p] == ["b", "b"]  # a one-tool catalog
