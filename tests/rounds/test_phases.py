"""Seconds by phase: blocks add up per phase, an unknown phase is named."""

from __future__ import annotations

import time

import pytest

from infer.rounds.phases import Phases


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


def test_a_phase_opened_inside_another_pauses_it():
    phases = Phases("drafting", "other")
    with phases("drafting"):
        time.sleep(0.02)
        with phases("other"):
            time.sleep(0.03)
        time.sleep(0.02)
    assert 0.03 <= phases.times["other"] < 0.04 + 0.02
    assert 0.04 <= phases.times["drafting"] < 0.05 + 0.02  # the inner 30 ms are not counted twice
    phases.add("forecast")
    with phases("forecast"):
        pass
    assert phases.times["forecast"] >= 0.0
