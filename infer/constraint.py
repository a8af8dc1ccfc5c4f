"""Schema-constrained choice (``decode.constrain=schema``): which tokens the response grammar
allows at the committed state and at every node of a draft tree.

The grammar is the response format the targets are trained to write, compiled per request
catalog with xgrammar (vLLM's and SGLang's engine; it compiles a BFCL catalog in ~6 ms on
this CPU and matches a token in microseconds, and its matcher rolls back, which a tree walk
needs): ``{"tool_calls": [call, ...]}`` where each call is ``{"name": <a catalog tool>,
"arguments": <that tool's parameters>}`` — its own keys, value types, enums and required
fields — serialised with ``", "`` and ``": "`` and no other whitespace, as the packer writes.
Keys follow the schema's order ("name" before "arguments", parameters as declared): the
grammar fixes the order the targets are trained to write.

``MainSession`` masks the target's logits with these sets before it chooses at each MAIN
node, so every speculative decoder's output equals constrained AR's (greedy), or follows
the constrained distribution (sampling), by the same argument as without constraints.
SIDE branches stay unconstrained: they only propose.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from infer.tree import ROOT

JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}


def json_schema(value: Any) -> Any:
    """A copy of a tool's parameter schema that a JSON Schema engine accepts: corpus types
    outside JSON Schema (BFCL's ``any``) lose their type constraint instead of failing."""
    if isinstance(value, list):
        return [json_schema(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if k == "type" and isinstance(v, str) and v not in JSON_TYPES:
            continue
        # "properties" maps names to schemas: a parameter may be called "type"
        out[k] = {name: json_schema(s) for name, s in v.items()} if k == "properties" and isinstance(v, dict) \
            else json_schema(v)
    return out


def response_schema(functions: list[dict]) -> dict:
    """The JSON Schema of a response that calls tools of ``functions`` (any number of calls)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": fn["name"]},
                             "arguments": json_schema(fn.get("parameters") or {"type": "object", "properties": {}})},
              "required": ["name", "arguments"], "additionalProperties": False} for fn in functions]
    return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": {"anyOf": calls}}},
            "required": ["tool_calls"], "additionalProperties": False}


class SchemaGrammars:
    """Compiled response grammars, one per catalog (requests sharing a catalog share it)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.cache: dict[str, Any] = {}
        self.compile_seconds: list[float] = []  # one per catalog compiled

    def constraint(self, functions: list[dict]) -> "Constraint":
        schema = json.dumps(response_schema(functions))  # keys in schema order: the grammar keeps it
        if schema not in self.cache:
            t = time.perf_counter()
            self.cache[schema] = self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                                   separators=(", ", ": "))
            self.compile_seconds.append(time.perf_counter() - t)
        return Constraint(self.xgr, self.cache[schema], self.vocab_size)


class Constraint:
    """One request's grammar state: the committed response so far."""

    def __init__(self, xgr: Any, grammar: Any, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(grammar, max_rollback_tokens=256)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32
        self.vocab_size = vocab_size
        self.shifts = torch.arange(32, dtype=torch.int32)

    def _allowed(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0, :, None] >> self.shifts) & 1  # [W, 32]
        return bits.reshape(-1)[: self.vocab_size].bool()  # [V]

    def masks(self, tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
        """[1 + m, V] allowed tokens after the committed text (row 0) and after each node's
        path (row 1 + i). A node the grammar forbids can never be accepted; its row and its
        subtree's are left all-true."""
        m = len(tree_tokens)
        out = torch.ones(1 + m, self.vocab_size, dtype=torch.bool)
        out[0] = self._allowed()
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)

        def walk(parent: int) -> None:
            for i in children.get(parent, []):
                if not self.matcher.accept_token(tree_tokens[i]):  # forbidden here: never accepted
                    continue
                out[1 + i] = self._allowed()
                walk(i)
                self.matcher.rollback(1)

        walk(ROOT)
        return out

    def advance(self, tokens: list[int]) -> None:
        """Commit tokens the masked target chose."""
        for t in tokens:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} violates the response grammar: the mask was not applied")
