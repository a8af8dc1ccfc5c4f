"""Alignment of the forecast with what MAIN realized, on small literal cases."""

from __future__ import annotations

from infer.align import current_call, is_stale, rebind, slots_to_open
from infer.packer import CallPlan
from schemafill.parser import parse_prefix

FUNCTIONS = {"a": {"name": "a", "parameters": {"properties": {"x": {}, "y": {}}, "required": ["x"]}},
             "b": {"name": "b", "parameters": {"properties": {"q": {}}}}}


def plans(*tools: str) -> list[CallPlan]:
    keys = {"a": (("x",), ("x", "y")), "b": (("q",), ("q",))}
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
