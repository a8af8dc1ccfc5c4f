"""The GPU check's own code path, on the CPU at the tiny shape (the device runs the 7B one)."""

from __future__ import annotations

import torch

from benchmarks.gpu_check import build, call_costs, decode_runs, host_ms_per_call, streamed_bytes
from schemafill.runtime.backends import cuda_graphs, eager


def test_tiny_shape_builds_and_times_every_call_on_both_paths():
    target, head = build("tiny", torch.device("cpu"), torch.float32)
    assert head.config.draft_vocab_size == target.config.vocab_size == 1000  # capped at the vocabulary
    c = target.config
    h, qkv = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    # Q/K/V with their biases (Qwen2), O, gate/up/down, two norms; then the final norm and the LM head
    layer = h * qkv + qkv + c.num_heads * c.head_dim * h + 3 * h * c.intermediate_size + 2 * h
    weights = c.num_layers * layer + h + c.vocab_size * h
    assert streamed_bytes(target) == 4 * weights  # fp32; the input embedding not counted
    graphs = target.backend = cuda_graphs.build(target, eager.build(target), capture=False)
    costs = call_costs(target, context=32, rows=[1, 2, 8], repeats=1)
    assert set(costs["eager"]) == set(costs["graph"]) == {1, 2, 8} and all(
        ms > 0 for path in ("eager", "graph") for ms in costs[path].values())
    assert target.backend is graphs and graphs.runner.replays > 0  # the graph column ran the bucketed calls
    head.steps = graphs.draft_steps(head)
    prompts = [list(range(5, 40)), list(range(50, 70))]
    runs = decode_runs(target, head, prompts, new_tokens=8)
    assert runs["ar"]["ids"] == runs["eagle3"]["ids"] and runs["ar"]["tokens"] == 16
    assert runs["ar"]["host_ms_per_round"] > 0 and head.steps.replays > 0


def test_host_time_per_call_is_what_the_calls_and_head_leave():
    rows = [{"seconds": 0.1, "call_ms": [30.0, 20.0], "head_ms": 10.0},
            {"seconds": 0.05, "call_ms": [40.0]}]
    assert host_ms_per_call(rows) == round((40.0 + 10.0) / 3, 3)
