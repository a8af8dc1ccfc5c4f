"""The tool-call data contract every stage agrees on (docs/design.md, "Contracts").

Owns ``ToolRequest`` (one OpenAI-style request: messages, tool catalog, optional
reference calls, and for a structured output the schema its answer follows), its validation and
normalisation, and the canonical validation of a response
``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, whose text ``response_format`` owns.
Prompt rendering lives in ``prompt``; parsing a partial response in ``parser``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from schemafill.contract import schemas
from schemafill.contract.response_format import JSON, KEY, ResponseFormat, object_format

ROLES = ("system", "user", "assistant", "tool")


class InvalidRequest(ValueError):
    """A record that is not a usable ToolRequest; the message says why."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolRequest:
    id: str
    messages: list[dict]  # [{"role": ..., "content": ...}]
    tools: list[dict]  # OpenAI format: [{"type": "function", "function": {...}}]
    source: str = ""
    category: str = ""
    reference: list[ToolCall] | None = None  # known ground truth, first acceptable value
    meta: dict = field(default_factory=dict)
    # a structured output: {"name": ..., "schema": {...}, "strict": bool}, the JSON Schema the
    # answer follows — one object, not tool calls, unless ``tools`` are offered too: then the
    # answer calls them or is that object; None for a tool-calling request
    output: dict | None = None

    @property
    def functions(self) -> list[dict]:
        """The catalog as plain function schemas ({name, description, parameters})."""
        return [t["function"] for t in self.tools]

    @property
    def output_function(self) -> dict | None:
        """A structured output's schema as the one function whose arguments the answer is."""
        if self.output is None:
            return None
        return {"name": self.output["name"], "description": self.output.get("description", ""),
                "parameters": self.output["schema"], "strict": self.output.get("strict", True)}

    @property
    def object_only(self) -> bool:
        """Is the answer the output schema's object, with no tools to call instead?"""
        return self.output is not None and not self.tools

    @property
    def slot_functions(self) -> list[dict]:
        """The functions whose arguments the answer may hold: the output schema's, or the catalog."""
        return [self.output_function] if self.object_only else self.functions

    def response_format(self, fmt: ResponseFormat) -> ResponseFormat:
        """How this request's answer is written, on a target that writes its calls in ``fmt``."""
        return object_format(self.output["name"]) if self.object_only else fmt

    @property
    def tool_names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def user_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")

    def to_dict(self) -> dict:
        out = {
            "id": self.id,
            "source": self.source,
            "category": self.category,
            "messages": self.messages,
            "tools": self.tools,
        }
        if self.reference is not None:
            out["reference"] = [c.to_dict() for c in self.reference]
        if self.meta:
            out["meta"] = self.meta
        if self.output is not None:
            out["output"] = self.output
        return out

    @classmethod
    def from_dict(cls, record: Any) -> "ToolRequest":
        """Validate and normalise one record; raise ``InvalidRequest`` naming the problem."""
        if not isinstance(record, dict):
            raise InvalidRequest(f"record is a {type(record).__name__}, not an object")
        rid = record.get("id")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest("missing or empty 'id'")
        messages = _validate_messages(record.get("messages"))
        output = _validate_output(record["output"]) if record.get("output") is not None else None
        tools = _validate_tools(record.get("tools")) if output is None or record.get("tools") else []
        reference = record.get("reference")
        if reference is not None:
            reference = _validate_calls(reference, "reference")
        meta = record.get("meta") or {}
        if not isinstance(meta, dict):
            raise InvalidRequest("'meta' must be an object")
        return cls(
            id=rid,
            messages=messages,
            tools=tools,
            source=str(record.get("source", "")),
            category=str(record.get("category", "")),
            reference=reference,
            meta=meta,
            output=output,
        )


def _validate_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidRequest(f"message {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise InvalidRequest(f"message {i} content is not a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise InvalidRequest("no user message")
    return out


def _validate_tools(tools: Any) -> list[dict]:
    if tools is None or tools == [] or tools == "":
        raise InvalidRequest("no tools")
    if not isinstance(tools, list):
        raise InvalidRequest(f"'tools' is a {type(tools).__name__}, not a list")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest(f"tool {i} is not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tool {i} has no name")
        if name in seen:
            raise InvalidRequest(f"tool name {name!r} appears twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tool {name!r}: parameters is a {type(params).__name__}, not a schema")
        params = schemas.normalize(params)
        if params.get("type", "object") != "object":
            raise InvalidRequest(f"tool {name!r}: parameters has type {params.get('type')!r}, not 'object'")
        if not isinstance(params.get("properties", {}), dict):
            raise InvalidRequest(f"tool {name!r}: parameters.properties is not an object")
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        description = fn.get("description", "")
        out.append({
            "type": "function",
            "function": {"name": name, "description": description if isinstance(description, str) else "",
                         "parameters": params},
        })
    return out


def _validate_output(output: Any) -> dict:
    """A structured output's schema, checked as a tool's parameters are (an object schema)."""
    if not isinstance(output, dict) or not isinstance(output.get("schema"), dict):
        raise InvalidRequest("'output' must be {'name': ..., 'schema': {...}, 'strict': ...}")
    name = output.get("name") or "response"
    fn = _validate_tools([{"name": name, "parameters": output["schema"]}])[0]["function"]
    out = {"name": name, "schema": fn["parameters"], "strict": bool(output.get("strict", True))}
    if isinstance(output.get("description"), str) and output["description"]:
        out["description"] = output["description"]
    return out


def _validate_calls(calls: Any, what: str) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{what}' is not a list")
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise InvalidRequest(f"{what} call {i} has no name")
        args = c.get("arguments", {})
        if not isinstance(args, dict):
            raise InvalidRequest(f"{what} call {i} arguments is not an object")
        out.append(ToolCall(c["name"], args))
    return out


# ---------------------------------------------------------------------- responses
def serialize_calls(calls: list[ToolCall], fmt: ResponseFormat = JSON) -> str:
    """The canonical response text for ``calls`` in ``fmt``."""
    return fmt.serialize([c.to_dict() for c in calls])


def parse_response(text: str, fmt: ResponseFormat = JSON) -> list[ToolCall] | None:
    """The calls of a complete response in ``fmt``, or None when it is not one valid response."""
    calls = fmt.parse(text)
    if calls is None:
        return None
    try:
        return _validate_calls(calls, KEY)
    except InvalidRequest:
        return None


_NORM_RE = re.compile(r"\s+")


def normalized_text(text: str) -> str:
    """Request text as compared for deduplication: case- and whitespace-insensitive."""
    return _NORM_RE.sub(" ", text.lower()).strip()
