"""Tool parameter schemas: one walk over a JSON schema's nested schemas, and the two copies the
project makes with it — BFCL's Python type names spelled as JSON Schema's (when a request is
read), and a copy a JSON Schema engine accepts (when the response grammar is compiled)."""

from __future__ import annotations

from typing import Any, Callable

# keywords whose value is a schema, or a list of schemas
SUBSCHEMAS = ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "prefixItems", "contains")
# keywords whose value maps names to schemas (a parameter may be called "type")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
# BFCL writes Python-flavoured types; JSON Schema spells them differently
TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array"}


def rewrite(schema: Any, node: Callable[[dict], dict]) -> Any:
    """A copy of ``schema`` with ``node`` applied to every schema object in it, nested ones
    first; values that are not schemas (``enum``, ``default``, ``required``...) are kept as they are."""
    if isinstance(schema, list):
        return [rewrite(s, node) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rewrite(s, node) for name, s in value.items()}
        elif key in SUBSCHEMAS:
            out[key] = rewrite(value, node)
        else:
            out[key] = value
    return node(out)


def normalize(schema: Any) -> Any:
    """A copy with BFCL's Python type names (``dict``, ``float``, ``tuple``) as JSON Schema's."""

    def node(s: dict) -> dict:
        kind = s.get("type")
        return {**s, "type": TYPE_ALIASES.get(kind, kind)} if isinstance(kind, str) else s

    return rewrite(schema, node)


def for_engine(schema: Any) -> Any:
    """A copy a JSON Schema engine accepts: corpus types outside JSON Schema (BFCL's ``any``)
    lose their type constraint instead of failing, and required keys that ``properties`` does
    not list join it as any-value properties (a grammar engine only writes listed keys, so it
    would let such an object miss them)."""

    def node(s: dict) -> dict:
        s = {k: v for k, v in s.items() if not (k == "type" and isinstance(v, str) and v not in JSON_TYPES)}
        required = s.get("required")
        if isinstance(required, list) and s.get("type", "object") == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            missing = {name: {} for name in required if isinstance(name, str) and name not in props}
            if missing:
                s["properties"] = {**props, **missing}
        return s

    return rewrite(schema, node)
