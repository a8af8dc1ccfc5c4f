"""Seconds by phase: blocks add up per phase, an unknown phase is named."""

from __future__ import annotations

import time

import pytest

from infer.phases import Phases


def test_blocks_add_to_their_phase_only():
    phases = Phases("drafting", "verification")
    for _ in range(2):
        with phases("drafting"):
            time.sleep(0.01)
    assert phases.times["drafting"] >= 0.02 and phases.times["verification"] == 0.0
    with pytest.raises(ZeroDivisionError):  # an exception still counts the time, and propagates
        with phases("verification"):
            1 / 0
    assert phases.times["verification"] > 0.0
    with pytest.raises(KeyError, match="drafitng"):
        with phases("drafitng"):
            pass
