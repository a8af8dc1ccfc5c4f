"""How good are a target's tool calls? Response-level quality metrics against the request's
catalog and reference: valid JSON, catalog tool names, exact match, call counts."""

from __future__ import annotations

import json
from collections import Counter

from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.toolcall import ToolCall, ToolRequest, parse_response


def _call_key(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "arguments": call.arguments}, sort_keys=True, ensure_ascii=False)


def exact_match(calls: list[ToolCall], reference: list[ToolCall]) -> bool:
    """Same calls, in any order (a multiset comparison of canonical call texts)."""
    return Counter(map(_call_key, calls)) == Counter(map(_call_key, reference))


def quality(requests: list[ToolRequest], responses: list[str], fmt: ResponseFormat = JSON) -> dict:
    """Pooled quality of ``responses[i]`` as answers to ``requests[i]``, read as ``fmt``."""
    if len(requests) != len(responses):
        raise ValueError(f"{len(requests)} requests but {len(responses)} responses")
    valid = names_ok = names_total = matched = with_ref = 0
    calls_made, reference_calls = [], []
    for req, text in zip(requests, responses):
        calls = parse_response(text.strip(), fmt)
        if calls is None:
            calls_made.append(0)
        else:
            valid += 1
            catalog = set(req.tool_names)
            names_total += len(calls)
            names_ok += sum(c.name in catalog for c in calls)
            calls_made.append(len(calls))
        if req.reference is not None:
            with_ref += 1
            reference_calls.append(len(req.reference))
            matched += calls is not None and exact_match(calls, req.reference)
    n = max(len(requests), 1)
    return {
        "requests": len(requests),
        "valid_json_rate": valid / n,
        "tool_name_accuracy": names_ok / names_total if names_total else 0.0,
        "exact_match": matched / with_ref if with_ref else None,
        "mean_calls": sum(calls_made) / n,
        "mean_reference_calls": sum(reference_calls) / len(reference_calls) if reference_calls else None,
    }
