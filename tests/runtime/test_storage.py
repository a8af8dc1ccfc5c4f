"""Arenas: on a CPU, memory only where written; kept for the next request (``ArenaStock``),
handed back zeroed, never to two owners."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from schemafill.runtime.storage import ArenaStock, KVArena

CPU = torch.device("cpu")


def take(stock: ArenaStock, capacity: int, dtype: torch.dtype = torch.float32) -> KVArena:
    return stock.take(2, 3, capacity, 8, dtype, CPU)


def test_a_new_arena_has_room_to_the_next_grain_for_later_prompts():
    stock = ArenaStock(grain=32)
    assert [take(stock, n).capacity for n in (1, 32, 33, 100)] == [32, 32, 64, 128]


def test_an_ended_requests_arena_is_the_next_ones_zeroed():
    stock = ArenaStock(grain=1)
    first = take(stock, 100)
    first.k[1].fill_(3.0)
    storage = first.k[1].data_ptr()
    stock.give(first)
    assert first.k == [] and first.v == []  # a late read fails instead of reading the next request's KV
    second = take(stock, 60)  # 100 slots hold 60 (at most twice as many as asked)
    assert second.k[1].data_ptr() == storage and second.capacity == 100
    assert not any(t.any() for t in second.k + second.v)
    assert take(stock, 60).k[1].data_ptr() != storage  # one owner at a time


def test_a_kept_arena_too_big_too_small_or_of_another_shape_is_not_handed_out():
    stock = ArenaStock(grain=1)
    stock.give(take(stock, 100))
    held = [take(stock, 40), take(stock, 101), take(stock, 100, torch.bfloat16)]
    assert [a.capacity for a in held] == [40, 101, 100]  # 100 would waste more than half of it for 40
    assert held[2].k[0].dtype == torch.bfloat16
    assert len(stock.free) == 1


def test_a_collected_arena_comes_back_once_and_the_stock_keeps_a_few():
    stock = ArenaStock(keep=2)
    arenas = [take(stock, 50) for _ in range(3)]
    stock.give(arenas[0])
    stock.give(arenas[0])  # given twice: kept once
    del arenas
    gc.collect()
    assert len(stock.free) == 2


def test_what_the_stock_did_not_hand_out_stays_out_and_inference_arenas_serve_inference_only():
    stock = ArenaStock(grain=1)
    own = KVArena(2, 1, 3, 50, 8, torch.float32, CPU)
    stock.give(own)
    assert own.k and not stock.free
    with torch.inference_mode():
        probe = take(stock, 50)
        storage = probe.k[0].data_ptr()
        stock.give(probe)
    outside = take(stock, 50)  # an in-place update of an inference tensor outside inference mode raises
    assert outside.k[0].data_ptr() != storage and not outside.k[0].is_inference()
    outside.k[0].add_(1.0)
    with torch.inference_mode():
        assert take(stock, 50).k[0].data_ptr() == storage


@pytest.mark.parametrize("backend", ["eager", "batch_invariant"])
def test_a_targets_request_arenas_come_from_its_stock(backend):
    from schemafill.runtime.loading import from_hf_model
    from tests.runtime.test_runtime import hf_model

    target = from_hf_model(hf_model("llama"), backend=backend)
    arena = target.new_arena(1, 300)
    storage = arena.k[0].data_ptr()
    target.arenas.give(arena)
    assert target.new_arena(1, 300).k[0].data_ptr() == storage
    assert target.new_arena(2, 64).rows == 2  # a batch's arena of many rows is its own


def test_a_fresh_arena_on_a_cpu_takes_memory_only_where_it_is_written():
    """An arena reserves room for a request's longest answer and every SIDE branch; only the
    slots written take memory (its pages are an anonymous mapping's, zero until written)."""
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    arena = KVArena(4, 1, 4, 1 << 16, 64, torch.float32, CPU)  # 4 layers, keys and values: 512 MB reserved
    assert arena.memory is not None and resident() - before < 64 << 20
    arena.k[2][0, :, :1024] = 1.0  # one layer's keys over 1,024 slots of each head: 1 MB
    assert resident() - before < 64 << 20
    assert arena.k[2][0, 1, 1023, 0] == 1.0 and arena.k[2][0, 1, 1024, 0] == 0.0
