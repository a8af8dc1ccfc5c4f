"""The response format, in one place: the canonical text of a tool-call response (DESIGN §2).

    {"tool_calls": [{"name": "t", "arguments": {"k": v, ...}}, ...]}

Everything that writes or predicts response text takes its pieces from here: the
serializer (``toolcall``), the prompt's format instructions (``prompt``), the packer's
bridges between fields and calls, the headers of SIDE branches and Parallel Fill's
contexts, and the separators of the response grammar (``infer/constraint``). Its texts
tokenize alike wherever they appear because they are the same strings. Pure: standard
library only.
"""

from __future__ import annotations

import json
from typing import Any

KEY = "tool_calls"
# what `json.dumps` writes by default and what prompts show the target, so MAIN and SIDE
# texts tokenize the same way
SEPARATORS = (", ", ": ")
HEADER = '{"' + KEY + '": ['  # the response up to its first call
FIELD_BRIDGE = ", "  # between two arguments of a call
CALL_BRIDGE = ", "  # between two calls
CALL_CLOSE = "}}"  # a call's arguments, then the call
CLOSE = "]}"  # the list of calls, then the response
TEMPLATE = '{"' + KEY + '": [{"name": "<tool name>", "arguments": {"<argument>": <JSON value>, ...}}, ...]}'
EMPTY = '{"' + KEY + '": []}'


def dumps(value: Any) -> str:
    """Canonical JSON text of one value (unicode kept, the canonical separators)."""
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


def serialize(calls: list[dict]) -> str:
    """The response text of ``calls`` (each ``{"name": ..., "arguments": {...}}``)."""
    return dumps({KEY: calls})


def call_header(tool: str) -> str:
    """A call of ``tool`` up to its first argument's key."""
    return '{"name": ' + dumps(tool) + ', "arguments": {'


def field_prefix(tool: str, key: str) -> str:
    """The response text a first call of ``tool`` has up to ``key``'s colon: the context a
    SIDE branch (and Parallel Fill) writes the key's value after."""
    return HEADER + call_header(tool) + dumps(key) + ":"
