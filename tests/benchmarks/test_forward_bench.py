"""The forward bench's own code, on a tiny random target (the bench runs the built-in one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.forward_bench import run, slopes, streamed_bytes, table
from schemafill.runtime.loading import load_target
from tests.conftest import tiny_llama


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_bytes_leave_out_the_gathered_embedding(tmp_path, tied):
    tiny_llama(vocab_size=300, seed=1, tie_word_embeddings=tied).save_pretrained(tmp_path)
    target = load_target(tmp_path, torch.float32, torch.device("cpu"), backend="eager")  # its bytes, whatever runs it
    unique = {id(p): p for p in target.parameters()}.values()
    every = sum(p.numel() * p.element_size() for p in unique)
    embed = target.model.embed_tokens.weight.numel() * 4
    # tied, the LM head reads the embedding whole; untied, the embedding's rows are only gathered
    assert streamed_bytes(target) == (every if tied else every - embed)
    half = load_target(tmp_path, torch.bfloat16, torch.device("cpu"), backend="eager")
    assert streamed_bytes(half) == streamed_bytes(target) // 2


def test_both_forwards_are_timed_at_every_shape(tiny_target):
    result = run(tiny_target, [torch.float32], contexts=(16, 32), sizes=(1, 32), repeats=1, with_hf=True)
    shapes = {(r["context"], r["rows"]) for r in result["rows"]}
    assert shapes == {(16, 1), (16, 32), (32, 1), (32, 32)}
    assert all(r["ours_ms"] > 0 and r["hf_ms"] > 0 and r["bound_ms"] > 0 for r in result["rows"])
    assert result["read_gb_s"] > 0 and result["host"]["cpu_capability"]
    assert set(slopes(result["rows"])) == {("float32", 16), ("float32", 32)}
    assert "c(32) / c(1)" in table(result)
