"""Timing in turn: every call warmed up once, then the calls alternate round after round."""

from __future__ import annotations

import time

import torch

from schemafill.runtime.timing import alternating_ms


def test_calls_alternate_after_one_warm_up_each_and_keep_their_order():
    order: list[str] = []
    calls = [lambda: order.append("a"), lambda: (order.append("b"), time.sleep(0.01))]
    a_ms, b_ms = alternating_ms(calls, torch.device("cpu"), repeats=3)
    assert order == ["a", "b"] * 4  # one warm-up round, then three timed ones
    assert b_ms >= 10.0 > a_ms  # each median belongs to its own call
