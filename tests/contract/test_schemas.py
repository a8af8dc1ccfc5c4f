"""The walk over a tool schema's nested schemas and the two copies made with it."""

from __future__ import annotations

from schemafill.contract.schemas import for_engine, normalize, rewrite


def test_the_walk_reaches_every_nested_schema_and_nothing_else():
    schema = {"type": "object", "default": {"type": "dict"}, "enum": [{"type": "dict"}],
              "properties": {"type": {"type": "dict"}, "xs": {"type": "array", "items": {"type": "dict"}},
                             "u": {"anyOf": [{"type": "dict"}, {"type": "null"}]}},
              "additionalProperties": {"type": "dict"}}
    seen = []
    rewrite(schema, lambda s: seen.append(s.get("type")) or s)
    # innermost first, the root last; the objects under default and enum are values, not schemas
    assert seen.count("dict") == 4 and seen[-1] == "object" and len(seen) == 8


def test_normalize_spells_bfcl_types_as_json_schema_and_leaves_the_rest():
    before = {"type": "dict", "properties": {"n": {"type": "float"}, "pair": {"type": "tuple", "items": {"type": "dict"}},
                                             "a": {"type": "any"}, "s": {"type": "String"}},
              "default": {"type": "dict"}}
    assert normalize(before) == {"type": "object", "properties": {
        "n": {"type": "number"}, "pair": {"type": "array", "items": {"type": "object"}}, "a": {"type": "any"},
        "s": {"type": "String"}}, "default": {"type": "dict"}}
    assert before["type"] == "dict"  # a copy: the input is left as it was


def test_for_engine_drops_unknown_types_but_keeps_a_parameter_named_type():
    s = for_engine({"type": "object", "properties": {"type": {"type": "string"}, "x": {"type": "any"}}})
    assert s == {"type": "object", "properties": {"type": {"type": "string"}, "x": {}}}
    # BFCL's parallel_29: an object that requires keys it does not list (the grammar must write them)
    s = for_engine({"type": "object", "required": ["adults", "kids"], "properties": {"kids": {"type": "integer"}}})
    assert s["properties"] == {"kids": {"type": "integer"}, "adults": {}}
    assert for_engine({"type": "object", "required": ["a"]})["properties"] == {"a": {}}
    nested = for_engine({"type": "array", "items": {"type": "object", "required": ["k"], "properties": {}}})
    assert nested["items"]["properties"] == {"k": {}}
