"""Prompt prefixes shared across requests: which kept prompt a new one starts from, what is
kept within the budget, and a request decoded from a reused prefix exactly as without it."""

from __future__ import annotations

import pytest
import torch

from infer.rounds import loop
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.rounds.prefixes import MIN_SHARED, PrefixCache, shared_length
from schemafill.contract.prompt import prompt_ids
from schemafill.runtime.loading import load_target, load_tokenizer
from schemafill.runtime.storage import KVArena
from tests.conftest import decode_ar
from tests.rounds.test_batch import methods
from tests.decoders.test_schemafill import request


def arena_of(n: int, fill: float) -> KVArena:
    a = KVArena(2, 1, 1, n + 8, 2, torch.float32, torch.device("cpu"))
    for t in a.k + a.v:
        t.fill_(fill)
    return a


def test_shared_length_literal():
    assert shared_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_length([], [1]) == 0 and shared_length([7, 8], [7, 8]) == 2


def test_a_prompt_starts_from_the_kept_one_it_shares_most_with_and_computes_its_last_token():
    cache = PrefixCache(1 << 20)
    base = list(range(100, 100 + 2 * MIN_SHARED))
    cache.keep(base, arena_of(len(base), 1.0), torch.ones(len(base), 3))
    cache.keep(base[:MIN_SHARED] + [1] * MIN_SHARED, arena_of(len(base), 2.0), torch.full((len(base), 3), 2.0))
    hit, n = cache.longest(base + [5, 6])
    assert n == len(base) and hit.tokens == tuple(base) and float(hit.k[0][0, 0, 0]) == 1.0
    assert cache.longest(base)[1] == len(base) - 1  # the same prompt: all but its last token
    assert cache.longest(base[:MIN_SHARED - 1] + [0] * 40) is None  # too little in common
    assert cache.reused_tokens == 2 * len(base) - 1
    cache.clear()
    assert cache.longest(base + [5, 6]) is None and cache.nbytes == 0  # cold again


def test_what_is_kept_stays_within_the_budget_least_recently_used_first():
    one = PrefixCache(0).keep  # nothing fits a budget of 0
    one(list(range(20)), arena_of(20, 0.0), torch.zeros(20, 3))
    a, b, c = ([k] * 40 for k in (1, 2, 3))
    per_token = 2 * 2 * 2 * 4 + 3 * 4  # k and v of 2 layers [1, n, 2] fp32, aux [n, 3]
    size = 40 * per_token
    cache = PrefixCache(2 * size + 8 * per_token)
    for p in (a, b):
        cache.keep(p, arena_of(40, 0.0), torch.zeros(40, 3))
    assert cache.nbytes == 2 * size
    cache.longest(a + [9])  # a is used again: b is the least recent
    cache.keep(c, arena_of(40, 0.0), torch.zeros(40, 3))
    assert [p.tokens[0] for p in cache.kept] == [1, 3]
    cache.keep(a + [4] * 8, arena_of(48, 0.0), torch.zeros(48, 3))  # extends a: replaces it
    assert sorted(len(p.tokens) for p in cache.kept) == [40, 48] and cache.nbytes == 2 * size + 8 * per_token
    before = list(cache.kept)
    cache.keep(a, arena_of(40, 0.0), torch.zeros(40, 3))  # covered by the longer one: nothing new
    assert cache.kept == before


@pytest.fixture(scope="module")
def tiny(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    return target, tok, frozenset({tok.eos_token_id})


def test_a_request_from_a_reused_prefix_decodes_as_without_it(tiny):
    """A first turn, then the same conversation carried on (a second turn) and another request
    beside it: the second turn starts from the first's prompt KV, leaves the KV a whole
    prefill would, and every output equals AR's without the cache."""
    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 12)
    first = request("one_tool")
    later = type(first)(id="later", messages=[*first.messages, {"role": "assistant", "content": "Let me check."},
                                              {"role": "user", "content": "Go on, call it."}], tools=first.tools)
    prompts = [prompt_ids(r, "plain", tok) for r in (first, later, request("bm25"))]
    assert shared_length(prompts[0], prompts[1]) > MIN_SHARED
    cache = PrefixCache(64 << 20)
    batch = loop.Batch(target, prefill_tokens=32, prefixes=cache)
    streams = []
    for p in prompts:
        st = loop.Stream(rt, p, DecodeOptions(), loop.Drafting())
        batch.add(st)
        streams.append(st)
        while st.s.n_kv < len(p) - 1 or not st.prefilled:
            batch.step()
    assert streams[0].reused == 0 and streams[1].reused == shared_length(prompts[0], prompts[1])
    fresh = loop.Stream(rt, prompts[1], DecodeOptions(), loop.Drafting())
    fresh.s.prefill()
    n = len(prompts[1])
    for mine, whole in zip(streams[1].s.arena.k + streams[1].s.arena.v, fresh.s.arena.k + fresh.s.arena.v):
        assert torch.allclose(mine[0, :, :n], whole[0, :, :n], atol=1e-5)
    while batch.streams:
        batch.step()
    for st, p in zip(streams, prompts):
        assert st.decoded().ids == decode_ar(target, tok, p, 12, eos).ids
    assert cache.reused_tokens >= streams[1].reused


@pytest.mark.parametrize("backend", ["eager", "batch_invariant"])
def test_an_answered_conversation_is_kept_and_its_next_turn_prefills_only_what_it_adds(tiny_target, backend):
    """A request answered by SchemaFill (its response's KV written by verified tree nodes),
    then a next turn whose prompt carries that prompt and answer on: it starts from both,
    leaves the KV a whole prefill would (the same bits on the batch-invariant backend), and
    decodes what AR decodes without the cache."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend=backend)
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    rt = Runtime(target, tok, eos, 12)
    sf = methods(target, tok, eos, 12)["schemafill"]
    first = request("one_tool")
    cache = PrefixCache(64 << 20)
    batch = loop.Batch(target, prefixes=cache)
    answered = sf.stream(first, prompt_ids(first, "plain", tok), DecodeOptions())
    batch.add(answered)
    while batch.streams:
        batch.step()
    held, aux = answered.s.sequence()
    assert len(held) == len(aux) > len(answered.s.prompt)  # the answer's KV is kept too
    assert held == answered.s.tokens[:len(held)] and len(held) >= min(answered.s.n_kv, len(answered.s.tokens))
    assert [p.tokens for p in cache.kept] == [tuple(held)]  # it replaced its prompt's entry
    after = held + prompt_ids(request("bm25"), "plain", tok)[:20]  # the next turn: the answer, then more
    nxt = loop.Stream(rt, after, DecodeOptions(), loop.Drafting())
    batch.add(nxt)
    assert nxt.reused == len(held)
    while batch.streams:
        batch.step()
    fresh = loop.Stream(rt, after, DecodeOptions(), loop.Drafting())
    fresh.s.prefill()
    n = len(after)
    for mine, whole in zip(nxt.s.arena.k + nxt.s.arena.v, fresh.s.arena.k + fresh.s.arena.v):
        if backend == "batch_invariant":
            assert torch.equal(mine[0, :, :n], whole[0, :, :n])
        assert torch.allclose(mine[0, :, :n], whole[0, :, :n], atol=1e-5)
    assert nxt.decoded().ids == decode_ar(target, tok, after, 12, eos).ids
