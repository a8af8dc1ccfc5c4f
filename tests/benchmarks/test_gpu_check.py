"""The GPU check's own code path, on the CPU at the tiny shape (the device runs the 7B one)."""

from __future__ import annotations

import torch

from benchmarks.gpu_check import build, verify_costs


def test_tiny_shape_builds_and_times_every_tree_size():
    target, head = build("tiny", torch.device("cpu"), torch.float32)
    assert head.config.draft_vocab_size == target.config.vocab_size == 1000  # capped at the vocabulary
    costs = verify_costs(target, context=32, sizes=[8, 16], repeats=1)
    assert set(costs) == {0, 8, 16} and all(s > 0 for s in costs.values())
