"""The OpenAI chat-completions protocol: a request body read into what the decoder needs,
every way it can be wrong named in an OpenAI-style error, and the answer objects.

Read: the conversation, tools and ``tool_choice``; ``response_format`` (``text``,
``json_object``, ``json_schema`` strict or not: a structured output); every sampling field
OpenAI has (``temperature``, ``top_p``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``, ``seed``) and vLLM's (``top_k``, ``min_p``, ``repetition_penalty``);
``stop``, ``logprobs`` / ``top_logprobs``, ``max_tokens``, ``stream``. Fields we do not use
(``user``, ``metadata``, ``parallel_tool_calls`` ...) are ignored as OpenAI-compatible
engines ignore them, and what we cannot honour (``n`` > 1, a structured output beside tools
on a target whose calls are not one JSON object) is refused by name rather than silently
dropped. A null field is an absent one. Pure: standard library and ``schemafill`` only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.toolcall import ToolRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function names, plus the dots BFCL's use


class APIError(Exception):
    """An error the client caused (4xx) or the server must refuse (503), as OpenAI writes it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, for a 503 (the ``Retry-After`` header)

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class ChatRequest:
    """One chat-completions request, checked."""

    request: ToolRequest  # the conversation and catalog, as every decoder reads a request
    model: str  # as the client named it (echoed back)
    method: str  # the decoding method serving it
    tool_choice: str  # auto | none | required | function
    function: str | None  # the function tool_choice names
    temperature: float
    top_p: float
    seed: int | None
    max_tokens: int | None  # None: the server's decode.max_new_tokens
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    # the rest of the sampling fields, as ``infer.rounds.sampling.SamplingParams`` names them
    penalties: dict[str, Any] = field(default_factory=dict)
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # top_logprobs when logprobs were asked for, else None

    @property
    def sampling(self) -> dict[str, Any]:
        """Every sampling field of the request, by ``SamplingParams``' names."""
        return {"temperature": self.temperature, "top_p": self.top_p, **self.penalties}

    @property
    def structured(self) -> bool:
        """A structured output only: the answer is one object under the request's JSON schema
        (beside tools it may call, an answer that is not a call is that object, as content)."""
        return self.request.object_only

    @property
    def constrained(self) -> bool:
        """``required`` and a named function decode under the response grammar: always a valid call."""
        return self.tool_choice in ("required", "function")

    @property
    def grammar_functions(self) -> list[dict]:
        """The functions the response grammar allows."""
        fns = self.request.functions
        return [f for f in fns if f["name"] == self.function] if self.tool_choice == "function" else fns


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise _bad("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    try:  # a lone surrogate ("\\ud800") is valid JSON but no text a tokenizer can read
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("the request body holds a lone UTF-16 surrogate (e.g. \\ud800): not text", code="invalid_json") \
            from None
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo < value if lo_open else lo <= value) and value <= hi):
        raise _bad(f"{key} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def _text(content: Any, param: str) -> str:
    """Message content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}] must be a text part ({{'type': 'text', 'text': ...}}): "
                           "this server reads text only", f"{param}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{param} must be a string or a list of text parts", param)


def _assistant_calls(calls: Any, param: str, fmt: ResponseFormat) -> str:
    """Earlier tool calls of the assistant, as the response text the target would have written."""
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                       f"{param}[{j}]")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise _bad(f"{param}[{j}].function.arguments is not a JSON string: {args[:60]!r}",
                       f"{param}[{j}].function.arguments") from None
        out.append({"name": fn["name"], "arguments": args})
    return fmt.serialize(out)


def parse_messages(messages: Any, fmt: ResponseFormat = JSON) -> list[dict]:
    """The conversation, an assistant's earlier calls written back as ``fmt`` response text."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{param} must be an object", param)
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
        if role == "assistant" and m.get("tool_calls"):
            content = _assistant_calls(m["tool_calls"], f"{param}.tool_calls", fmt)
        else:
            content = _text(m.get("content"), f"{param}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        param = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad(f"{param}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                       f"{param}.function.name")
        if name in names:
            raise _bad(f"{param}.function.name {name!r} is given twice", f"{param}.function.name")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad(f"{param}.function.parameters must be a JSON Schema of type object, got "
                       f"{json.dumps(params)[:80]}", f"{param}.function.parameters")
        out.append({"type": "function", "function": dict(fn)})  # as sent: the prompt shows the client's schema
    return out


def parse_tool_choice(choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise _bad(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function, got {choice!r}",
                       "tool_choice")
        if choice == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                   "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names the function {name!r}, which is not in tools ({names})", "tool_choice")
    return "function", name


def parse_chat_request(body: dict, models: dict[str, str], request_id: str, temperature: float = 1.0,
                       fmt: ResponseFormat = JSON) -> ChatRequest:
    """``body`` checked and read; ``models`` maps the model ids served to their methods;
    ``temperature`` is the one a request that names none decodes at (the server's
    ``decode.temperature``: 0, greedy, unless it was launched otherwise); ``fmt`` is the
    target's response format, in which earlier assistant calls are written back."""
    body = {k: v for k, v in body.items() if v is not None}  # null means absent, as in OpenAI's API
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        raise APIError(404, f"model {model!r} is not served here; the models are {list(models)}", "model",
                       "model_not_found")
    if body.get("n", 1) != 1:
        raise _bad("n must be 1: this server decodes one choice per request", "n")
    tools = parse_tools(body.get("tools"))
    choice, function = parse_tool_choice(body.get("tool_choice"), tools)
    output = parse_response_format(body.get("response_format"))
    if output is not None and tools and choice == "auto" and (fmt.in_words or fmt.bare is not None):
        raise _bad(f"a response_format schema beside tools the model may call needs a target whose calls are "
                   f"one JSON object (this one writes {fmt.name}): send tool_choice 'none' for the structured "
                   "answer, or leave response_format out for a tool call", "response_format")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise _bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise _bad(f"seed must be an integer in [0, 2**63), got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    # tool_choice none: the object alone; auto: calls or the object; required or named: a call
    request = ToolRequest(id=request_id, messages=parse_messages(body.get("messages"), fmt),
                          tools=[] if output is not None and choice == "none" else tools, source="api", output=output)
    return ChatRequest(request=request, model=model, method=models[model], tool_choice=choice, function=function,
                       temperature=_number(body, "temperature", temperature, 0.0, 2.0),
                       top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=seed, max_tokens=max_tokens,
                       stream=stream, include_usage=bool(options.get("include_usage")),
                       penalties=parse_penalties(body), stops=parse_stop(body.get("stop")),
                       logprobs=parse_logprobs(body))


def parse_response_format(value: Any) -> dict | None:
    """``response_format`` as a structured output (``ToolRequest.output``), or None for text."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":  # any object: nothing to hold its keys to
        return {"name": "response", "schema": {"type": "object"}, "strict": False}
    if kind != "json_schema":
        raise _bad(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got "
                   f"{json.dumps(value)[:80]}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise _bad("response_format.json_schema must be {'name': ..., 'schema': {...}, 'strict': ...}",
                   "response_format.json_schema")
    name = spec.get("name", "response")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"response_format.json_schema.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                   "response_format.json_schema.name")
    schema = spec.get("schema", {"type": "object"})
    if schema.get("type", "object") != "object":
        raise _bad(f"response_format.json_schema.schema must be a JSON Schema of type object (the answer is one "
                   f"object), got type {schema.get('type')!r}", "response_format.json_schema.schema")
    out = {"name": name, "schema": schema, "strict": bool(spec.get("strict", False))}
    if isinstance(spec.get("description"), str):
        out["description"] = spec["description"]
    return out


def parse_penalties(body: dict) -> dict[str, Any]:
    """The sampling fields beyond temperature and top_p, checked (``SamplingParams`` names)."""
    out: dict[str, Any] = {}
    for key in ("frequency_penalty", "presence_penalty"):
        if key in body:
            out[key] = _number(body, key, 0.0, -2.0, 2.0)
    if "min_p" in body:
        out["min_p"] = _number(body, "min_p", 0.0, 0.0, 1.0)
    if "repetition_penalty" in body:
        out["repetition_penalty"] = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise _bad(f"top_k must be an integer >= -1 (-1 or 0: off), got {top_k!r}", "top_k")
        out["top_k"] = max(top_k, 0)
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise _bad("logit_bias must map token ids to numbers in [-100, 100]", "logit_bias")
        pairs = []
        for token, value in bias.items():
            if not str(token).isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise _bad(f"logit_bias must map token ids to numbers in [-100, 100], got {token!r}: {value!r}",
                           "logit_bias")
            pairs.append((int(token), float(value)))
        out["logit_bias"] = tuple(pairs)
    return out


def parse_stop(stop: Any) -> tuple[str, ...]:
    """``stop``: one string or a list of them, none empty."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise _bad("stop must be a non-empty string or a list of at most 16 of them", "stop")
    return tuple(stops)


def parse_logprobs(body: dict) -> int | None:
    """``top_logprobs`` when ``logprobs`` is true (0 without it), else None."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise _bad(f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
    if not body.get("logprobs"):
        if top:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def logprobs_content(tokenizer: Any, ids: list[int], scores: list) -> list[dict]:
    """OpenAI's ``logprobs.content`` of committed tokens ``ids`` with their ``scores``
    (``(logprob, [(id, logprob), ...])`` each): token text, bytes and the top alternatives."""
    def entry(i: int, lp: float) -> dict:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]} for i, (lp, top) in zip(ids, scores)]


# ------------------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int, target_calls: int, method: str) -> dict:
    """OpenAI's usage, plus how the tokens were decoded."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "target_calls": target_calls,
            "accept_length": round(completion_tokens / target_calls, 4) if target_calls else None, "method": method}


def completion(completion_id: str, created: int, model: str, msg: dict, finish: str, use: dict,
               logprobs: list[dict] | None = None) -> dict:
    """A whole answer; ``logprobs``: its ``logprobs.content`` when the request asked for them."""
    lp = None if logprobs is None else {"content": logprobs}
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": lp}], "usage": use}


def chunk(completion_id: str, created: int, model: str, delta: dict, finish: str | None = None,
          use: dict | None = None, choices: bool = True, logprobs: list[dict] | None = None) -> dict:
    """One streamed chunk; ``choices=False`` is the usage-only last chunk (``include_usage``);
    ``logprobs``: the ``logprobs.content`` of the tokens committed since the last chunk."""
    lp = None if logprobs is None else {"content": logprobs}
    out = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}] if choices else []}
    if use is not None:
        out["usage"] = use
    return out
