"""Tool and slot forecast (paper §4.2; docs/design.md, "SchemaFill, step by step": forecast): where
draft compute goes, never what is emitted.

BM25 (``rank_bm25``) ranks the catalog against the request: the query is every message of
the conversation; a tool's document is its name split into words (on ``_ . -`` and
camelCase), its description, and its fields' names (split the same way) and
descriptions. Ties keep catalog order; a one-tool catalog is not ranked. The ranking is
cycled (a request may call one tool several times) and cut to the first ``budget`` call
groups; each group's tool becomes a ``CallPlan`` of its predicted keys, the slots SIDE
branches prepare.

Decision (the paper leaves it open): the keys a call is *predicted* to write are its
required keys in schema order, or every key when none is required. Optional keys the
target does write are still taken from its own output (the packer follows MAIN).
"""

from __future__ import annotations

import re

from infer.slots.guesses import schema_choices
from infer.slots.packer import CallPlan
from schemafill.contract.toolcall import ToolRequest

_WORD = re.compile(r"[A-Za-z][a-z]*|[a-z]+|[0-9]+|[^\W\d_]+", re.UNICODE)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def words(text: str) -> list[str]:
    """Lower-cased words; identifiers split on ``_ . -`` and camelCase."""
    return [w.lower() for w in _WORD.findall(_CAMEL.sub(" ", re.sub(r"[_.\-]", " ", text)))]


def tool_document(fn: dict) -> list[str]:
    params = fn.get("parameters") or {}
    doc = words(fn.get("name", "")) + words(fn.get("description", "") or "")
    for key, spec in (params.get("properties") or {}).items():
        doc += words(key)
        if isinstance(spec, dict):
            doc += words(str(spec.get("description", "") or ""))
    return doc


def rank_tools(request: ToolRequest) -> list[int]:
    """Catalog indices, most relevant first (ties in catalog order)."""
    functions = request.functions
    if len(functions) <= 1:
        return list(range(len(functions)))
    from rank_bm25 import BM25Okapi

    docs = [tool_document(fn) or ["_"] for fn in functions]  # BM25 cannot take an empty document
    query = words(" ".join(m["content"] for m in request.messages))
    scores = BM25Okapi(docs).get_scores(query)
    return sorted(range(len(functions)), key=lambda i: (-float(scores[i]), i))


def forecast_groups(ranking: list[int], budget: int) -> list[int]:
    """The first ``budget`` call groups of the cycled ranking (catalog indices)."""
    if not ranking:
        return []
    return [ranking[i % len(ranking)] for i in range(budget)]


def predicted_keys(fn: dict) -> list[str]:
    params = fn.get("parameters") or {}
    keys = list((params.get("properties") or {}).keys())
    required = [k for k in keys if k in set(params.get("required") or [])]
    return required or keys


# schema type names, JSON Schema's and the looser ones catalogs use, by how their values start
_KINDS = {"string": "string", "str": "string", "char": "string", "integer": "number", "int": "number",
          "long": "number", "number": "number", "float": "number", "double": "number", "boolean": "boolean",
          "bool": "boolean", "array": "array", "list": "array", "tuple": "array", "object": "object",
          "dict": "object"}


def value_kind(spec: object) -> str:
    """How a value of the schema ``spec`` starts (``packer.OPENINGS``): "string", "number",
    "boolean", "array" ("array_string" when its items are strings) or "object"; "" where the
    schema does not say (no type, a union, an unknown name)."""
    kind = _KINDS.get(spec["type"].lower(), "") if isinstance(spec, dict) and isinstance(spec.get("type"), str) else ""
    if kind == "array" and value_kind(spec.get("items")) == "string":
        return "array_string"
    return kind


def call_plan(fn: dict) -> CallPlan:
    """The plan of one call of ``fn``: its predicted keys, its schema's keys, their kinds of
    value and the literals a value is one of (an enum's, a boolean's), nothing prepared."""
    props = (fn.get("parameters") or {}).get("properties") or {}
    kinds = {k: kind for k, spec in props.items() if (kind := value_kind(spec))}
    choices = {k: literals for k, spec in props.items() if (literals := schema_choices(spec))}
    return CallPlan(fn["name"], tuple(predicted_keys(fn)), tuple(props), {}, kinds, choices)
