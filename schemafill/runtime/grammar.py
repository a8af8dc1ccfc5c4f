"""The response grammar: which tokens a response may take next, at its committed state
and at every node of a draft tree (decoding under ``decode.constrain=schema`` or a
structured output, and generating the continuations a head learns structured outputs from).

The grammar is the response format the targets are trained to write, compiled per request
catalog with xgrammar (vLLM's and SGLang's engine; it compiles a catalog in milliseconds, matches
a token in microseconds, and its matcher rolls back, which a tree walk needs): ``{"tool_calls": [call, ...]}`` where each call is ``{"name": <a catalog tool>,
"arguments": <that tool's parameters>}`` — its own keys, value types, enums and required
fields — serialised with ``", "`` and ``": "`` and no other whitespace, as the packer writes.
Keys follow the schema's order ("name" before "arguments", parameters as declared): the
grammar fixes the order the targets are trained to write.

``MainSession`` masks the target's logits with these sets before it chooses at each MAIN
node, so every speculative decoder's output equals constrained AR's (greedy), or follows
the constrained distribution (sampling), by the same argument as without constraints.
Around that choice:

* draft nodes the grammar forbids after their path (drafts, bridges, packed SIDE values
  alike) are pruned before verification: they could never be accepted;
* a token the grammar allows alone is *forced*: after each verification the session
  commits forced tokens at once, with no target decision, and counts every forced token of
  the response (however it was committed) so AL can be reported without them;
* near the length cap the grammar closes what may close (``Constraint``), so a target
  caught in a loop still ends with a complete response.

SIDE branches stay unconstrained: they only propose, and what they prepare meets the
grammar when it is packed into MAIN's tree. ``valid_response`` checks outputs against the
same schema with ``jsonschema``, independently of xgrammar.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from schemafill.contract import schemas
from schemafill.contract.response_format import JSON, KEY, SEPARATORS, ResponseFormat, dumps, object_format

ROOT = -1  # the parent of a draft tree's top nodes (as in ``infer/rounds/tree.py``)


def call_schemas(functions: list[dict], fmt: ResponseFormat = JSON) -> list[dict]:
    """The JSON Schema of one call of each tool of ``functions``, its keys in ``fmt``'s order
    (a grammar keeps the schema's order)."""
    out = []
    for fn in functions:
        props = {"name": {"const": fn["name"]},
                 "arguments": schemas.for_engine(fn.get("parameters") or {"type": "object", "properties": {}})}
        out.append({"type": "object", "properties": fmt.call_object(props),
                    "required": ["name", "arguments"], "additionalProperties": False})
    return out


def response_schema(functions: list[dict], min_calls: int = 0, fmt: ResponseFormat = JSON) -> dict:
    """The JSON Schema of a response that calls tools of ``functions`` (as the json format's
    object; other formats' calls are read into one): any number of calls, at least
    ``min_calls`` (1 for a server's ``tool_choice: required``). A structured output's
    (``fmt.bare``) is its one function's parameters: the object itself."""
    if fmt.bare is not None:
        return schemas.for_engine(functions[0].get("parameters") or {"type": "object"})
    calls_list = {"type": "array", "items": {"anyOf": call_schemas(functions, fmt)},
                  **({"minItems": min_calls} if min_calls else {})}
    return {"type": "object", "properties": {KEY: calls_list}, "required": [KEY], "additionalProperties": False}


def format_grammar(xgr: Any, tokenizer: Any, functions: list[dict], fmt: ResponseFormat, min_calls: int = 0) -> Any:
    """The response grammar of a format other than json, as an xgrammar structural tag: its
    header, calls (each the canonical JSON of one catalog call, as the json grammar writes
    them) joined by its bridge, its closing; or, without ``min_calls``, its reply without
    calls. A lead marker the vocabulary holds as one special token (Mistral's ``[TOOL_CALLS]``)
    is that token, as the model writes it. EOS after a formats's closing is the grammar's end."""
    from xgrammar import structural_tag as st

    calls = {"anyOf": call_schemas(functions, fmt)}
    call = st.GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(
        json.dumps(calls), any_whitespace=False, separators=SEPARATORS)))
    head: list = [st.ConstStringFormat(value=fmt.header)]
    if fmt.lead is not None:
        marker = tokenizer.convert_tokens_to_ids(fmt.lead)
        if marker is not None and marker != tokenizer.unk_token_id:  # one token of the vocabulary
            head = [st.TokenFormat(token=marker), st.ConstStringFormat(value=fmt.header[len(fmt.lead):])]
    more = st.StarFormat(content=st.SequenceFormat(elements=[st.ConstStringFormat(value=fmt.call_bridge), call]))
    calls_text = st.SequenceFormat(elements=[*head, call, more, st.ConstStringFormat(value=fmt.close)])
    root = calls_text if min_calls else st.OrFormat(elements=[calls_text, st.ConstStringFormat(value=fmt.empty)])
    return st.StructuralTag(format=root)


def minimal_value(schema: Any) -> Any:
    """A shortest value the schema allows (required keys only, empty strings and lists, zeros):
    roughly what finishing a value that has just begun costs."""
    if not isinstance(schema, dict):
        return 0
    if schema.get("enum"):
        return min(schema["enum"], key=lambda v: len(json.dumps(v)))
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: minimal_value(props.get(k, {})) for k in schema.get("required", [])}
    if kind == "array":
        return [minimal_value(schema.get("items") or {}) for _ in range(schema.get("minItems", 0))]
    return {"string": "", "boolean": False, "null": None}.get(kind, 0)


def valid_response(text: str, functions: list[dict], min_calls: int = 0, fmt: ResponseFormat = JSON) -> bool:
    """Whether ``text`` is a complete ``fmt`` response whose calls validate against the response
    schema of ``functions`` (checked by ``jsonschema``, independently of the grammar engine)."""
    import jsonschema

    try:
        if fmt.bare is not None:
            obj = json.loads(text)
        elif fmt.in_words:  # the format's calls, validated as the json format's list would be
            calls = fmt.parse(text.strip())
            if calls is None:
                return False
            obj = {KEY: calls}
        else:
            obj = json.loads(text)
        jsonschema.validate(obj, response_schema(functions, min_calls, fmt))
    except (ValueError, jsonschema.ValidationError):  # json.JSONDecodeError is a ValueError
        return False
    return True


def scan(state: tuple[bool, bool], piece: bytes) -> tuple[bool, bool]:
    """(inside a JSON string, after a backslash there) once ``piece`` is appended."""
    inside, escaped = state
    for b in piece:
        if escaped:
            escaped = False
        elif inside and b == 0x5C:  # backslash
            escaped = True
        elif b == 0x22:  # quote
            inside = not inside
    return inside, escaped


class SchemaGrammars:
    """Compiled response grammars, one per catalog (requests sharing a catalog share it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, fmt: ResponseFormat = JSON,
                 stop_ids: frozenset[int] | None = None) -> None:
        """``stop_ids``: the target's EOS ids (default: the tokenizer's), which end a response in
        formats that are not self-closing."""
        import xgrammar as xgr

        self.xgr, self.vocab_size, self.tokenizer, self.fmt = xgr, vocab_size, tokenizer, fmt
        stops = sorted(stop_ids) if stop_ids else None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.pieces: list[bytes] = list(self.info.decoded_vocab[:vocab_size])
        # [3, V] closing tokens outside a string (only ']' and '}'), inside one ('"' first,
        # then only ']' and '}': a '}' inside a string is text, it closes nothing), and the
        # ones that end a value and move on to the next key (',' with ']', '}' and spaces):
        # where an object still needs keys, that is the way out
        self.closers = torch.zeros(3, vocab_size, dtype=torch.bool)
        for i, piece in enumerate(self.pieces):
            if piece and set(piece) <= set(b'"]}'):
                self.closers[0, i] = b'"' not in piece
                self.closers[1, i] = piece[:1] == b'"'
            if b"," in piece and set(piece) <= set(b",]} "):
                self.closers[2, i] = True
        if not fmt.self_closing:  # after the closing text, the way out is EOS
            self.closers[0, [i for i in self.info.stop_token_ids if i < vocab_size]] = True
        self.cache: dict[str, Any] = {}
        self.compile_seconds: list[float] = []  # one per catalog compiled

    def constraint(self, functions: list[dict], enforce: bool = True, min_calls: int = 0,
                   close_at: int | None = None, fmt: ResponseFormat | None = None,
                   alternative: dict | None = None) -> "Constraint":
        """The request's grammar state; ``enforce=False`` only prunes drafts (``Constraint``).
        ``close_at``: the response token from which a catalog whose longest call is 0 tokens
        would start closing (None: never); each catalog starts earlier by the tokens of its
        longest minimal call (``minimal_value``), as a call begun just then must still end.
        ``fmt``: the request's format where it is not the launch's (a structured output, whose
        one function's ``strict`` says whether fields its schema does not list may appear).
        ``alternative``: a structured output's function whose object may answer instead of the
        calls (the json format only: both are then one JSON object)."""
        fmt = fmt or self.fmt
        strict = functions[0].get("strict", True) if fmt.bare is not None else True
        tree = response_schema(functions, min_calls, fmt)
        if alternative is not None:
            if fmt.name != JSON.name:
                raise ValueError(f"an answer that may be calls or an object needs the json format, not {fmt.name}")
            tree = {"anyOf": [tree, response_schema([alternative], fmt=object_format(alternative["name"]))]}
            strict = alternative.get("strict", True)
        schema = json.dumps(tree)  # keys in schema order: kept
        key = schema if strict else "loose:" + schema
        if key not in self.cache:
            t = time.perf_counter()
            if fmt.name == JSON.name or fmt.bare is not None:  # one JSON value, calls or an object
                self.cache[key] = self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                                    separators=SEPARATORS, strict_mode=strict)
            else:
                self.cache[key] = self.compiler.compile_structural_tag(
                    format_grammar(self.xgr, self.tokenizer, functions, fmt, min_calls))
            self.compile_seconds.append(time.perf_counter() - t)
        base, close_at = close_at, None
        if base is not None and enforce:
            # a tagged format's closing text must fit too (json's one "]}" token never counted:
            # kept so, its constrained outputs stay as recorded)
            tail = fmt.close if fmt.in_words else ""

            def shortest(fn: dict, bare: bool) -> str:  # a structured output's object, or one call
                args = minimal_value(fn.get("parameters"))
                return dumps(args) if bare else dumps(fmt.call_object({"name": fn["name"], "arguments": args})) + tail

            calls = [shortest(fn, fmt.bare is not None) for fn in functions]
            calls += [shortest(alternative, True)] if alternative is not None else []
            longest = max((len(self.tokenizer(c, add_special_tokens=False).input_ids) for c in calls), default=0)
            close_at = max(base - longest, 0)
        return Constraint(self.xgr, self.cache[key], self.pieces, self.closers, close_at, enforce)


class Constraint:
    """One request's grammar state: the committed response so far.

    From response token ``close_at`` on (``max_new_tokens - decode.close_margin``), wherever
    the grammar allows a closing token only those are allowed: inside a string, a token that
    ends it (``"`` first, then only ``]`` and ``}``); outside, one made of ``]`` and ``}``,
    and where neither may come (an object that still needs keys), one made of ``,`` (with
    ``]``, ``}`` and spaces) that ends the value and moves on. So a value, list or object
    that could go on ends as soon as it may, and a target caught in a loop (say, digits of a
    number while required keys remain) still writes a complete response before the cap. It is part of the
    grammar's contract, a function of the prefix like the rest, so every decoder applies it
    alike.

    With ``enforce=False`` (``decode.constrain=prune``) the target stays free: the grammar
    only drops draft nodes it forbids, a bet that the target writes valid calls which costs
    acceptance, never correctness, when lost. Once the target writes outside the grammar,
    nothing more is pruned for the request.
    """

    def __init__(self, xgr: Any, grammar: Any, pieces: list[bytes], closers: torch.Tensor,
                 close_at: int | None = None, enforce: bool = True) -> None:
        self.enforce, self.lost = enforce, False
        self.vocab_size = len(pieces)
        self.matcher = xgr.GrammarMatcher(grammar, max_rollback_tokens=256)
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V/32)] int32
        self.pieces, self.closers, self.close_at = pieces, closers, close_at
        self.shifts = torch.arange(32, dtype=torch.int32)
        self.count = 0  # response tokens committed
        self.string = (False, False)  # the committed text ends inside a string / after a backslash in one
        self._next_row: torch.Tensor | None = None  # next_allowed() until the committed text moves

    def _allowed(self, index: int, string: tuple[bool, bool]) -> torch.Tensor:
        """[V] the tokens allowed as response token ``index`` after the matcher's state, which
        leaves the text inside a string or not (``string``, as ``scan`` tracks it). Once the
        matcher has taken EOS nothing follows, and nothing is masked."""
        if self.matcher.is_terminated():
            return torch.ones(self.vocab_size, dtype=torch.bool)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0, :, None] >> self.shifts) & 1  # [W, 32]
        allowed = bits.reshape(-1)[: self.vocab_size].bool()
        if self.close_at is not None and index >= self.close_at and not string[1]:
            closing = allowed & self.closers[int(string[0])]
            if closing.any():
                return closing
            onward = allowed & self.closers[2]
            if not string[0] and onward.any():  # e.g. after a number while required keys remain
                return onward
        return allowed

    def check(self, tree_tokens: list[int], parents: list[int]) -> tuple[torch.Tensor | None, list[bool]]:
        """Which nodes of a draft tree the grammar allows after their path, and the allowed
        tokens after the committed text (row 0) and after each allowed node's path (row 1 + i),
        as a [1 + m, V] bool mask. A forbidden node can never be accepted, nor can its
        subtree: its row (and theirs) is left all-true, and it is reported False.
        Without ``enforce`` there are no rows (None): the nodes are only checked."""
        m = len(tree_tokens)
        if self.lost:
            return None, [True] * m
        out = torch.ones(1 + m, self.vocab_size, dtype=torch.bool) if self.enforce else None
        allowed = [False] * m
        if out is not None:
            out[0] = self.next_allowed()
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)

        def walk(parent: int, row: int, depth: int, string: tuple[bool, bool]) -> None:
            for i in kids.get(parent, []):
                # the row says what the (possibly closing) grammar allows; the matcher must agree
                if (out is not None and not out[row, tree_tokens[i]]) or not self.matcher.accept_token(tree_tokens[i]):
                    continue
                allowed[i] = True
                if not self.matcher.is_terminated():  # after EOS nothing is committed: no row, no subtree
                    inner = string
                    if out is not None:
                        inner = scan(string, self.pieces[tree_tokens[i]])
                        out[1 + i] = self._allowed(self.count + depth, inner)
                    walk(i, 1 + i, depth + 1, inner)
                self.matcher.rollback(1)

        walk(ROOT, 0, 1, self.string)
        return out, allowed

    def next_allowed(self) -> torch.Tensor:
        """[V] the tokens allowed after the committed text (asked after every commit, to find
        forced tokens, and again by the next ``check``)."""
        if self._next_row is None:
            self._next_row = self._allowed(self.count, self.string)
        return self._next_row

    def forced(self) -> int | None:
        """The one token the grammar allows next, if it allows exactly one (and enforces it)."""
        if not self.enforce:
            return None
        allowed = self.next_allowed()
        return int(allowed.nonzero()[0]) if int(allowed.sum()) == 1 else None

    def advance(self, tokens: list[int]) -> None:
        """Commit tokens the masked target chose (or the grammar forced)."""
        for t in tokens:
            if self.lost:
                return
            if not self.matcher.accept_token(t):
                if self.enforce:
                    raise RuntimeError(f"token {t} violates the response grammar: the mask was not applied")
                self.lost = True  # the free target left the grammar: stop pruning
                return
            self.count += 1
            self.string = scan(self.string, self.pieces[t])
            self._next_row = None
