"""Alignment of the forecast with what MAIN realized (paper §4.3, DESIGN §4.5), between rounds.

Each round MAIN's parse state says which call it is in and which of that call's fields it
has written. The plans follow: the current call's plan is rebound to the tool MAIN chose;
a SIDE branch whose call is over, whose field MAIN wrote, or whose plan changed tool is
stale; new branches go to the current and next call, predicted keys first. A slot is a
(call, key) pair. Pure: what changes is returned or written into the plans list given.
"""

from __future__ import annotations

from infer.forecast import call_plan
from infer.packer import CallPlan
from schemafill.parser import ParseState


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
