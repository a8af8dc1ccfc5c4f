"""The packer (paper §4.2 "Cross-call packing"; docs/design.md, "SchemaFill, step by step": each
round): the text MAIN is predicted to write next, chaining structural bridges and prepared
values across fields and calls.

Pure (standard library only). Given MAIN's committed response text and its parse state,
the call plans (one tool per call position, from the forecast, rebound to what MAIN
realized) and the prepared values, it builds the canonical serialization the target was
asked for, in its response format (``schemafill.contract.response_format``)::

    {"tool_calls": [{"name": "t", "arguments": {"k": v, ...}}, ...]}    # json
    <tool_call>\n{"name": "t", "arguments": {...}}\n</tool_call>\n...     # hermes
    <tool_call>\n{"arguments": {...}, "name": "t"}\n</tool_call>\n...     # hermes3

from the start of the current call — realized name and realized values as MAIN wrote
them, then predicted keys with prepared values — and proposes whatever of it extends the
committed text, up to the first value nobody has prepared. If MAIN deviated from the
canonical layout (other spacing, an unforeseen key), nothing is proposed: the drafter's
own tree still runs, and the target decides every token either way.

Decisions: a partially written key is completed with the first predicted key, then any
schema key, that starts with it; after the last predicted call the list is closed; with
``cross_calls`` off (ablation C) the proposal stops at the end of the current call. In a
format that writes a call's name after its arguments (``hermes3``) the call is the plan's
tool until its name is written (``align.rebind_by_keys`` keeps that plan in line with the
keys MAIN writes), and once MAIN closes the arguments before the predicted keys ran out,
the call goes on from its realized fields to the name (name-first formats keep proposing
nothing there, as before).
Beyond the paper, a value still being prepared may be given as ``provisional`` text, keyed
by (call, key) (what its SIDE branch has so far): the proposal then runs through it and stops there, so MAIN
can catch up with a long value its branch started rounds earlier instead of re-drafting
it with the head alone.
Beyond the paper, ``close`` guesses where an open value ends: a provisional value, and the value
MAIN is writing when nothing prepared matches it, are closed right where their text stops (a
string's quote; a number's next structural character) and the proposal goes on with the
structure and values after them. Where a value ends is the one thing the structure cannot
know, and without the guess the round that writes a value's last token stops there and the
next round's correction is only the closing character; the chain after it waits a round more.
The closing character is tagged ``close_string`` / ``close_number`` so its acceptance is
learnt apart.
Beyond the paper, a value nobody has prepared still starts as its schema's type says (a string's
quote, an array's bracket: ``OPENINGS``, tagged ``open``), and the proposal says which characters
the unknown value may start with (``Packed.then``): the tokenizer decides whether the text before
it ends in a token of its own (a space before a digit) or in one that merges with the value
(``response_format.stable_continuation_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from schemafill.contract.parser import ParseState
from schemafill.contract.response_format import FIELD_BRIDGE, JSON, ResponseFormat, dumps


@dataclass(frozen=True)
class CallPlan:
    tool: str
    keys: tuple[str, ...]  # keys predicted to be written, in order
    schema_keys: tuple[str, ...] = ()  # every key of the tool's schema, in order
    values: dict[str, str] = field(default_factory=dict)  # key -> prepared value literal
    types: dict[str, str] = field(default_factory=dict)  # key -> the schema's kind of value (``OPENINGS``)
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> the literals its schema allows


# what each piece of a proposal is, for the acceptance estimates (infer/pricing/acceptance.py)
BRIDGE, VALUE, PROVISIONAL = "bridge", "value", "provisional"
GUESS = "guess"  # a value nobody prepared, guessed from the schema or the request (``guesses.py``)
GUESS_END = "guess_end"  # a guessed value's end: a string's quote, what follows a number
CLOSE_STRING, CLOSE_NUMBER = "close_string", "close_number"  # the guessed end of an open value
CLOSES = (CLOSE_STRING, CLOSE_NUMBER)
# where a call ends, another may follow (NEXT: the bridge to it) or the response may end (END:
# the closing after the last call): structure, but the one choice in it the plans may get wrong
NEXT, END = "next", "end"
OPEN = "open"  # the start of an unknown value its schema's type fixes: structure the plan may get wrong
# (text, kind); text None where a value is unknown, and its kind then a ``Stop``
Piece = tuple[str | None, "str | Stop"]

# what a value of each kind of schema starts with, and the characters that may follow that
# start: a string's quote, then a letter; a number's digit; an array of strings' '["', ...
OPENINGS: dict[str, tuple[str, str]] = {
    "string": ('"', "aA"), "number": ("", "15"), "boolean": ("", "tf"), "array": ("[", '1"[{'),
    "array_string": ('["', "aA"), "object": ("{", '"}'),
}
ANY_VALUE = '"1[{tn'  # what a value of no known kind may start with


def value_start(kind: str) -> tuple[str, str]:
    """What a value of ``kind`` (``CallPlan.types``) starts with, and the characters that may
    follow that start."""
    return OPENINGS.get(kind, ("", ANY_VALUE))


class Stop(NamedTuple):
    """Where a proposal stops: before the value of ``slot`` (call, key) nobody has prepared,
    which may start with the characters ``then`` ("" where they are not worth saying: a
    provisional value goes on in a word)."""

    then: str
    slot: tuple[int, str]


class Packed(NamedTuple):
    """A proposal: its text, each character's kind, the characters the unknown value after
    it may start with ("" where the text ends otherwise), and that value's (call, key)."""

    text: str
    kinds: list[str]
    then: str = ""
    slot: tuple[int, str] | None = None


def closing(literal: str) -> Piece | None:
    """How the open value ``literal`` would end right here: a string's quote, a number's
    nothing (the structure after it ends it); None where it cannot end yet (an empty string,
    a pending escape, a number's sign, point or exponent) or is no string or number."""
    if literal.startswith('"'):
        backslashes = len(literal) - len(literal.rstrip("\\"))
        return ('"', CLOSE_STRING) if len(literal) > 1 and backslashes % 2 == 0 else None
    if literal[:1] in tuple("-0123456789") and literal[-1] not in "+-.eE":
        return "", CLOSE_NUMBER
    return None


def _call_pieces(fmt: ResponseFormat, call: int, tool: str, fields: list[tuple[str, str | None]],
                 provisional: dict[str, str] | None = None, close: bool = False,
                 types: dict[str, str] | None = None, guessed: dict[str, str] | None = None) -> list[Piece]:
    """Text pieces of call ``call`` in ``fmt``'s key order (its name before or after its
    arguments); a ``Stop`` where a value is unknown (the proposal stops there, after the
    value's provisional prefix if it has one, or, with ``close``, goes on as if the value ended
    there; else after the start its kind in ``types`` fixes). A ``guessed`` value is written
    as if prepared."""
    out: list[Piece] = [(fmt.call_header(tool), BRIDGE)]
    for i, (key, value) in enumerate(fields):
        out.append(((FIELD_BRIDGE if i else "") + dumps(key) + ": ", BRIDGE))
        if value is None and provisional and key in provisional:
            out.append((provisional[key], PROVISIONAL))
            end = closing(provisional[key]) if close else None
            if end is not None:
                out.append(end)
                continue
            out.append((None, Stop("", (call, key))))
            continue
        if value is None and guessed and key in guessed:
            literal = guessed[key]
            # where a guess is likeliest wrong: a string's closing quote, what follows a number
            out += [(literal[:-1], GUESS), ('"', GUESS_END)] if literal[:1] == '"' and len(literal) > 1 else \
                [(literal, GUESS), ("", GUESS_END)]
            continue
        if value is None:
            opening, then = value_start((types or {}).get(key, ""))
            if opening:
                out.append((opening, OPEN))
            out.append((None, Stop(then, (call, key))))
            continue
        out.append((value, VALUE))
    out.append((fmt.call_close(tool), BRIDGE))
    return out


def _plan_pieces(fmt: ResponseFormat, call: int, plan: CallPlan, provisional: dict[str, str] | None,
                 close: bool = False, guessed: dict[str, str] | None = None) -> list[Piece]:
    return _call_pieces(fmt, call, plan.tool, [(k, plan.values.get(k)) for k in plan.keys], provisional, close,
                        plan.types, guessed)


def _join(pieces: list[Piece]) -> Packed:
    """The text up to the first unknown piece, the kind of each of its characters (an empty
    closing piece — a number's end, a guessed value's — tags the character after it), what the
    unknown piece may start with, and whose value it is."""
    text: list[str] = []
    kinds: list[str] = []
    carry = None
    for p, kind in pieces:
        if p is None:
            return Packed("".join(text), kinds, kind.then, kind.slot)
        if kind in CLOSES + (GUESS_END,) and not p:
            carry = kind
            continue
        text.append(p)
        kinds += [kind] * len(p)
        if carry and p:
            kinds[len(kinds) - len(p)] = carry
            carry = None
    return Packed("".join(text), kinds)


def _realized(text: str, state: ParseState) -> list[tuple[str, str]]:
    return [(key, text[a:b]) for key, a, b in state.spans]


def _current_fields(text: str, state: ParseState, plan: CallPlan) -> list[tuple[str, str | None]] | None:
    """Realized fields, then the one being written, then the predicted rest; None when MAIN's
    partial key matches no key of the tool."""
    fields: list[tuple[str, str | None]] = list(_realized(text, state))
    done = {k for k, _ in fields}
    if state.in_key:
        partial = text[text.rfind('"') + 1:]
        pool = [k for k in plan.keys if k not in done] + [k for k in plan.schema_keys if k not in done]
        key = next((k for k in pool if k.startswith(partial)), None)
        if key is None:
            return None
        fields.append((key, plan.values.get(key)))
        done.add(key)
    elif state.field is not None and state.field not in done:  # key closed, value open or not started
        partial = text[state.value_start:] if state.in_value else ""
        value = plan.values.get(state.field)
        fields.append((state.field, value if value is not None and value.startswith(partial) else None))
        done.add(state.field)
    elif state.spans and text[state.spans[-1][2]:].strip() == "," and all(k in done for k in plan.keys):
        # MAIN goes on past the predicted keys: the schema's next key after the last it wrote
        # (a grammar keeps the schema's order), an optional one the forecast left out
        last = state.spans[-1][0]
        later = plan.schema_keys[plan.schema_keys.index(last) + 1:] if last in plan.schema_keys else ()
        key = next((k for k in later if k not in done), None)
        if key is not None:
            fields.append((key, plan.values.get(key)))
            done.add(key)
    fields += [(k, plan.values.get(k)) for k in plan.keys if k not in done]
    return fields


def propose(text: str, state: ParseState, plans: list[CallPlan], cross_calls: bool = True,
            provisional: dict[tuple[int, str], str] | None = None, fmt: ResponseFormat = JSON,
            close: bool = False) -> str:
    """The predicted continuation of MAIN's committed ``text`` (empty when there is none)."""
    return propose_tagged(text, state, plans, cross_calls, provisional, fmt, close)[0]


def propose_tagged(text: str, state: ParseState, plans: list[CallPlan], cross_calls: bool = True,
                   provisional: dict[tuple[int, str], str] | None = None, fmt: ResponseFormat = JSON,
                   close: bool = False, guessed: dict[tuple[int, str], str] | None = None) -> Packed:
    """``propose``, with the kind of each character — a structural bridge (call header, keys,
    separators, closings), a value's schema-fixed start, a prepared value, a provisional value
    still being prepared, a guessed value, or (``close``) the guessed end of an open value —
    and what the unknown value after it may start with, and whose value that is.

    ``guessed``: values, keyed by (call, key), written as if prepared (``guesses.py``); the
    value MAIN is writing is guessed only by a literal that starts with what it wrote."""
    ahead: dict[int, dict[str, str]] = {}  # call -> key -> unclosed value prefix
    for (j, key), prefix in (provisional or {}).items():
        ahead.setdefault(j, {})[key] = prefix
    guesses: dict[int, dict[str, str]] = {}  # call -> key -> guessed literal
    for (j, key), literal in (guessed or {}).items():
        guesses.setdefault(j, {})[key] = literal
    if state.closed or state.error is not None:
        return Packed("", [])
    if state.call_index is not None:  # inside call j: rebuild it from its "{"
        j = state.call_index
        plan = plans[j] if j < len(plans) else None
        tool = state.tool_name or (plan.tool if plan else None)
        if tool is None or plan is None or plan.tool != tool:
            return Packed("", [])  # the caller rebinds plans to realized tools before asking
        fields = _current_fields(text, state, plan)
        if fields is None:
            return Packed("", [])
        if state.in_value and state.field is not None and dict(fields).get(state.field) is None:
            partial, mine = text[state.value_start:], guesses.get(j, {})
            if not mine.get(state.field, "").startswith(partial):
                mine.pop(state.field, None)
            if state.field not in mine and close and not ahead.get(j, {}).get(state.field, "").startswith(partial):
                # nothing prepared or guessed matches the value MAIN is writing: unless a
                # provisional value runs on from it, guess that MAIN's own ends here
                ahead.setdefault(j, {})[state.field] = partial
        # a provisional value MAIN has already run past proposes nothing (no prefix match)
        base, nxt = text[:state.call_start], j + 1
        found = _extend(text, base, _call_pieces(fmt, j, tool, fields, ahead.get(j), close, plan.types, guesses.get(j)),
                        nxt, plans, ahead, cross_calls, fmt, close, guesses)
        if found is None:
            # MAIN closed (or is closing) the arguments before the predicted keys: its
            # realized fields, then the call's close (args-first formats: the name) and what follows
            realized = list(_realized(text, state))
            if realized != fields:
                found = _extend(text, base, _call_pieces(fmt, j, tool, realized, ahead.get(j), close, plan.types,
                                                         guesses.get(j)), nxt, plans, ahead, cross_calls, fmt, close,
                                guesses)
        return found or Packed("", [])
    if state.calls_started:  # between calls: after the "}" of the last one
        base, pieces, nxt = text[:state.last_call_end], [], state.calls_started
    else:  # no call yet
        base, pieces, nxt = "", [(fmt.header, BRIDGE)], 0
        if nxt < len(plans):
            pieces += _plan_pieces(fmt, 0, plans[0], ahead.get(0), close, guesses.get(0))
            nxt = 1
    return _extend(text, base, pieces, nxt, plans, ahead, cross_calls, fmt, close, guesses) or Packed("", [])


def _extend(text: str, base: str, pieces: list[Piece], nxt: int, plans: list[CallPlan],
            ahead: dict[int, dict[str, str]], cross_calls: bool, fmt: ResponseFormat, close: bool = False,
            guesses: dict[int, dict[str, str]] | None = None) -> Packed | None:
    """``base`` + ``pieces`` (then, across calls, the plans from ``nxt`` on and the closing)
    past ``text``, with each character's kind; None when that text does not extend ``text``."""
    if cross_calls or not pieces or pieces == [(fmt.header, BRIDGE)]:
        pieces = list(pieces)
        for j in range(nxt, len(plans)):
            pieces += [(fmt.call_bridge, NEXT)] + _plan_pieces(fmt, j, plans[j], ahead.get(j), close,
                                                               (guesses or {}).get(j))
        pieces.append((fmt.close, END if nxt else BRIDGE))
    joined, kinds, then, slot = _join(pieces)
    predicted = base + joined
    if not predicted.startswith(text):
        return None
    kinds = [BRIDGE] * len(base) + kinds
    return Packed(predicted[len(text):], kinds[len(text):], then, slot)


def token_kinds(tokenizer: Any, committed: list[int], text: str, suffix: str, kinds: list[str],
                ids: list[int], fmt: ResponseFormat = JSON) -> list[str]:
    """The kind of each token of ``ids`` (``continuation_ids`` of ``suffix``): the riskiest kind
    among the characters it covers (provisional over value over bridge)."""
    rank = {BRIDGE: 0, NEXT: 1, END: 1, OPEN: 1, VALUE: 2, PROVISIONAL: 3, GUESS: 3, CLOSE_STRING: 4, CLOSE_NUMBER: 4,
            GUESS_END: 4}
    # character offsets from a short tail of the committed tokens: decoding the whole response
    # per token would cost more than the tags are worth (a tag only steers the estimates)
    tail = committed[-4:]
    start = len(fmt.decode(tokenizer, tail))
    out, done = [], 0
    for j in range(len(ids)):
        end = len(fmt.decode(tokenizer, tail + ids[: j + 1])) - start
        span = kinds[max(done, 0):max(end, done + 1)] or kinds[-1:] or [BRIDGE]
        out.append(max(span, key=rank.__getitem__))
        done = end
    return out
