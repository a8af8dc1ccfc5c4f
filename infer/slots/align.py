"""Alignment of the forecast with what MAIN realized (paper §4.3; docs/design.md, "SchemaFill, step
by step": align), between rounds.

Each round MAIN's parse state says which call it is in and which of that call's fields it
has written. The plans follow: the current call's plan is rebound to the tool MAIN chose
(by its name; in formats that write the name after the arguments, first by the keys MAIN
writes, ``rebind_by_keys``, then by the name when it comes);
a SIDE branch whose call is over, whose field MAIN wrote, or whose plan changed tool is
stale; new branches go to the current and next call, predicted keys first. A slot is a
(call, key) pair. Pure: what changes is returned or written into the plans list given.
"""

from __future__ import annotations

from typing import Iterable

from infer.slots.forecast import call_plan
from infer.slots.packer import CallPlan
from schemafill.contract.parser import ParseState


def current_call(state: ParseState) -> int:
    """The call MAIN is writing, or the next one between calls."""
    return state.call_index if state.call_index is not None else state.calls_started


def rebind(plans: list[CallPlan], j: int, tool: str, functions: dict[str, dict]) -> dict[int, int]:
    """Make ``plans[j]`` a plan for the realized ``tool``, in place: swap in a later group
    with that tool (its branches and prepared values follow it), else a fresh plan. An
    unknown tool leaves the plans alone (the packer then proposes nothing for the call).
    Returns how branches' calls move, ``{old: new}`` (empty when none do)."""
    if (j < len(plans) and plans[j].tool == tool) or tool not in functions:
        return {}
    if j >= len(plans):  # more calls than forecast groups
        plans.extend(call_plan(functions[tool]) for _ in range(j + 1 - len(plans)))
        return {}
    later = next((g for g in range(j + 1, len(plans)) if plans[g].tool == tool), None)
    if later is None:
        plans[j] = call_plan(functions[tool])
        return {}
    plans[j], plans[later] = plans[later], plans[j]
    return {j: later, later: j}


def written_keys(text: str, state: ParseState) -> tuple[tuple[str, ...], str]:
    """The argument keys MAIN has written in its current call (closed values, then the key
    whose value is open or about to start), and the key it is writing, as typed so far
    ("" when none)."""
    keys = [k for k, _, _ in state.spans]
    if state.field is not None and state.field not in keys:
        keys.append(state.field)
    partial = text[text.rfind('"') + 1:] if state.in_key else ""
    return tuple(keys), partial


def holds_keys(schema_keys: Iterable[str], keys: tuple[str, ...], partial: str = "") -> bool:
    """A schema of ``schema_keys`` has every key in ``keys`` and, while one is typed
    (``partial``), a further key starting with it."""
    schema_keys = tuple(schema_keys)
    return all(k in schema_keys for k in keys) and (
        not partial or any(k.startswith(partial) and k not in keys for k in schema_keys))


def _holds(fn: dict, keys: tuple[str, ...], partial: str) -> bool:
    return holds_keys((fn.get("parameters") or {}).get("properties") or {}, keys, partial)


def rebind_by_keys(plans: list[CallPlan], j: int, keys: tuple[str, ...], functions: dict[str, dict],
                   partial: str = "") -> dict[int, int]:
    """Before call j's name is written (formats that write it after the arguments), keep
    ``plans[j]`` to a tool whose schema holds the argument ``keys`` MAIN wrote in it (and the
    one it is typing, ``partial``), in place, like ``rebind`` does with a realized name.

    Nothing changes while the plan's tool holds them. Else the plan is swapped with the
    first later group whose tool holds them (the forecast's ranking decides among several;
    branches and prepared values follow their plans); else, when exactly one catalog tool
    holds them, it becomes a fresh plan that keeps the prepared values of the keys it shares
    (in those formats a SIDE branch's context is the same text for every tool: it ends
    before any name). When none, or several catalog tools and no later group, hold them,
    the plans are left alone: the name settles it. With no plan for call j (more calls than
    forecast groups) one is added when exactly one tool fits. Returns ``{old: new}`` call
    moves, as ``rebind``. In name-first formats it is never needed (no key comes before the
    name) and the decoder does not call it."""
    if j < len(plans):
        current = functions.get(plans[j].tool)
        if current is not None and _holds(current, keys, partial):
            return {}
        later = next((g for g in range(j + 1, len(plans))
                      if plans[g].tool in functions and _holds(functions[plans[g].tool], keys, partial)), None)
        if later is not None:
            plans[j], plans[later] = plans[later], plans[j]
            return {j: later, later: j}
    fits = [name for name, fn in functions.items() if _holds(fn, keys, partial)]
    if len(fits) != 1:
        return {}
    fresh = call_plan(functions[fits[0]])
    if j >= len(plans):
        plans.extend(call_plan(functions[fits[0]]) for _ in range(j - len(plans)))
        plans.append(fresh)
        return {}
    fresh.values.update({k: v for k, v in plans[j].values.items() if k in fresh.schema_keys})
    plans[j] = fresh
    return {}


def is_stale(call: int, tool: str, key: str, current: int, realized: set[tuple[int, str]],
             plans: list[CallPlan]) -> bool:
    """A branch for (call, key) of ``tool`` can no longer be used by MAIN."""
    return call < current or (call, key) in realized or call >= len(plans) or plans[call].tool != tool


def slots_to_open(plans: list[CallPlan], current: int, optional: bool) -> list[tuple[int, str]]:
    """Slots of the current and next call, in the order branches open for them: predicted
    keys first, then (``optional``) the schema's other keys, whose values MAIN uses only if
    it writes the key (the packer never proposes an unpredicted key by itself)."""
    calls = [j for j in (current, current + 1) if j < len(plans)]
    slots = [(j, k) for j in calls for k in plans[j].keys]
    if optional:
        slots += [(j, k) for j in calls for k in plans[j].schema_keys if k not in plans[j].keys]
    return slots
