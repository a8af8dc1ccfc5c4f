"""Bucketed target calls (the CUDA graphs backend): padding and the KV pool change nothing real.

On a CPU the runner runs the padded calls eagerly (``capture=False``): everything but the CUDA
capture itself. The capture is checked where a GPU is present.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from infer.proposers.head import HeadDrafter, TreeBudget
from schemafill.config import ModelConfig
from schemafill.runtime import backends
from schemafill.runtime.backends import cuda_graphs
from schemafill.runtime.backends.cuda_graphs import ROW_BUCKETS, CudaGraphs, HeadGraphs, bucket
from schemafill.runtime.calls import Part
from schemafill.runtime.loading import from_hf_model
from schemafill.runtime.storage import KVArena, width_bucket
from tests.conftest import decode_ar, decode_tree
from tests.decoders.test_decoders import CharTokenizer, RandomTree, random_head
from tests.runtime.test_runtime import VOCAB, hf_model


def bucketed(target, capture: bool = False) -> CudaGraphs:
    """``target`` (on the eager backend) with its calls bucketed, as CUDA graphs where ``capture``."""
    target.backend = cuda_graphs.build(target, target.runs_on(), capture=capture)
    return target.backend


def graphed_head(head, target) -> HeadGraphs:
    head.steps = target.runs_on().draft_steps(head)
    return head.steps


def pair(family: str = "llama", device: str = "cpu"):
    """The same random target twice: eager, and with its calls bucketed (and the runner of its buckets)."""
    plain = from_hf_model(hf_model(family, seed=3).to(device), aux_layer_ids=[1, 2, 3], backend="eager")
    graphed = from_hf_model(hf_model(family, seed=3).to(device), aux_layer_ids=[1, 2, 3], backend="eager")
    return plain, graphed, bucketed(graphed, capture=device == "cuda").runner


def test_buckets():
    rows = (1, 2, 3, 5, 64, 65, 129, 512, 513)
    assert [bucket(n, ROW_BUCKETS) for n in rows] == [1, 2, 4, 8, 64, 128, 256, 512, None]
    assert [width_bucket(n, 4096) for n in (1, 256, 257, 1000, 1025, 5000)] == [256, 256, 512, 1024, 2048, 4096]
    assert width_bucket(3000, 2048) == 2048  # never past the pool's capacity


def visibility_after(width: int, n: int, parents: list[int]) -> torch.Tensor:
    """[n, width + n]: every row sees the ``width`` committed slots, itself and its ancestors."""
    v = torch.zeros(n, width + n, dtype=torch.bool)
    v[:, :width] = True
    for i, p in enumerate(parents):
        v[i, width + i] = True
        if p >= 0:
            v[i, width:] |= v[p, width:]
    return v


def test_padded_calls_give_the_unpadded_logits_features_and_kv():
    plain, graphed, runner = pair()
    rng = random.Random(0)
    lengths = (40, 90)
    arenas = [(plain.new_arena(1, 130), graphed.new_arena(1, 130)) for _ in lengths]
    assert [runner.pool.row_of(a) for _, a in arenas] == [1, 2]  # rows of the pool; 0 is the scratch row
    for (a, b), n in zip(arenas, lengths):  # prefills, one at a time
        ids = torch.tensor([rng.randrange(VOCAB) for _ in range(n)])
        pos = torch.arange(n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for target, arena in ((plain, a), (graphed, b)):
            target.packed(ids, pos, [Part(arena, 0, pos, causal)], torch.tensor([n - 1]))
    # both requests verify a tree in one call: 3 + 5 rows, padded to 8 rows, 2 parts, 256 slots
    trees = [[-1, 0, 0], [-1, 0, 1, 1, 3]]
    tokens, positions, parts = [], [], {"plain": [], "graphed": []}
    start = 0
    for (a, b), n, parents in zip(arenas, lengths, trees):
        k = len(parents)
        tokens += [rng.randrange(VOCAB) for _ in parents]
        depth = [0] * k
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
        positions += [n + d for d in depth]
        vis, slots = visibility_after(n, k, parents), torch.arange(n, n + k)
        parts["plain"].append(Part(a, start, slots, vis))
        parts["graphed"].append(Part(b, start, slots, vis))
        start += k
    ids, pos, at = torch.tensor(tokens), torch.tensor(positions), torch.tensor([0, 2, 3, 7])
    want = plain.packed(ids, pos, parts["plain"], at)
    got = graphed.packed(ids, pos, parts["graphed"], at)
    assert runner.summary()["buckets"] == [(8, 2, 256), (64, 1, 256), (128, 1, 256)]  # the prefills too
    assert got.logits.shape == want.logits.shape == (1, 4, VOCAB)
    assert got.aux.shape == want.aux.shape and got.final.shape == want.final.shape
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(got.aux, want.aux, rtol=0, atol=2e-5)
    torch.testing.assert_close(got.final, want.final, rtol=0, atol=2e-5)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    for (a, b), n, parents in zip(arenas, lengths, trees):
        used = n + len(parents)
        for layer in range(plain.config.num_layers):
            torch.testing.assert_close(b.k[layer][0, :, :used], a.k[layer][0, :, :used], rtol=0, atol=2e-5)
            torch.testing.assert_close(b.v[layer][0, :, :used], a.v[layer][0, :, :used], rtol=0, atol=2e-5)
            assert not b.k[layer][0, :, used:].any() and not b.v[layer][0, :, used:].any()  # nothing else written
    # the padded rows wrote to the scratch row, and only there
    assert runner.pool.k[0][0].any()


def test_decoders_over_bucketed_calls_equal_ar():
    plain, graphed, runner = pair("qwen2")
    head = random_head(graphed, seed=5)
    head_runner = graphed_head(head, graphed)
    tok = CharTokenizer(-1)
    rng = random.Random(1)
    for case in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
        ar = decode_ar(plain, tok, prompt, 24, frozenset())
        assert decode_ar(graphed, tok, prompt, 24, frozenset()).ids == ar.ids
        for drafter in (RandomTree(case), HeadDrafter(head, TreeBudget(topk=3, depth=3, total=8))):
            out = decode_tree(graphed, tok, prompt, 24, frozenset(), drafter, scratch=32)
            assert out.ids == ar.ids, (case, type(drafter).__name__)
    summary = runner.summary()
    assert summary["replayed_calls"] > 40 and len({rows for rows, _, _ in summary["buckets"]}) >= 3
    assert head_runner.replays > 10
    gc.collect()
    assert runner.pool.rows <= 3  # each request's arena went back to the pool when its decode ended


def test_head_draft_steps_over_buckets_draft_the_eager_trees():
    """Lossless decoding does not show a wrong head step (any draft is verified): the trees do."""
    plain, graphed, _ = pair("qwen2")
    eager, in_buckets = random_head(plain, seed=5), random_head(graphed, seed=5)
    runner = graphed_head(in_buckets, graphed)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(40, 3 * plain.config.hidden_size, generator=g)
    tokens = torch.randint(0, VOCAB, (44,), generator=g).tolist()
    budget = TreeBudget(topk=3, depth=3, total=8)
    drafters = [HeadDrafter(eager, budget), HeadDrafter(in_buckets, budget)]
    for d in drafters:
        d.begin(64)
    for done, new in ((0, 20), (20, 3), (23, 1), (24, 9)):  # a catch-up, then rounds accepting 2, 0 and 8
        trees = [d.scored(tokens[:done + new + 1], features[done:done + new]) for d in drafters]
        assert trees[1][:2] == trees[0][:2]  # tokens and parents
        torch.testing.assert_close(torch.tensor(trees[1][2]), torch.tensor(trees[0][2]), rtol=1e-4, atol=1e-6)
    n = 33
    torch.testing.assert_close(drafters[1].arena.k[0][0, :, :n], drafters[0].arena.k[0][0, :, :n], rtol=0, atol=1e-5)
    assert runner.replays >= 12 and runner.eager == 0


def test_batched_rounds_of_every_method_over_buckets_equal_each_alone(tiny_target):
    """Several requests a round (SIDE rows and prompt pieces included), their parts bucketed into
    one call: each ends as it ends alone on the eager target."""
    from infer.rounds import loop
    from infer.rounds.decoding import DecodeOptions, Runtime
    from schemafill.contract.prompt import prompt_ids
    from schemafill.runtime.loading import load_target, load_tokenizer
    from tests.decoders.test_schemafill import CASES, request
    from tests.rounds.test_batch import methods

    plain, graphed = (load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], "eager") for _ in range(2))
    backend = bucketed(graphed)
    runner = backend.runner
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    rt = Runtime(graphed, tok, eos, 16)
    jobs = []
    declared = methods(graphed, tok, eos, 16)
    for k, method in enumerate(("ar", "eagle3", "toolspec", "schemafill")):
        decoder, req = declared[method], request(list(CASES)[k])
        ids = prompt_ids(req, "plain", tok)
        make = (lambda ids=ids: loop.Stream(rt, ids, DecodeOptions(), loop.Drafting())) if decoder is None else \
            (lambda decoder=decoder, req=req, ids=ids: decoder.stream(req, ids, DecodeOptions()))
        jobs.append((method, make, decode_ar(plain, tok, ids, 16, eos)))
    replay, parts_seen = backend._replay, []

    def checked(tokens, positions, parts, logits_at):  # every bucketed call against the eager one
        got = replay(tokens, positions, parts, logits_at)
        if got is not None:
            want = backend.eager.packed(tokens, positions, parts, logits_at)  # rewrites the same keys and values
            torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=2e-5)
            torch.testing.assert_close(got.aux, want.aux, rtol=0, atol=2e-5)
            parts_seen.append(len(parts))
        return got

    backend._replay = checked
    ended = dict(loop.decode_all(graphed, [make for _, make, _ in jobs], 4, prefill_tokens=16))
    for i, (method, _, alone) in enumerate(jobs):
        assert ended[i].error is None and ended[i].decoded().ids == alone.ids, method
    assert max(parts_seen) == 4 and len(parts_seen) > 10
    assert runner.eager == 1  # the first round alone: whole prompts while nobody decodes, past the largest bucket


def test_calls_no_bucket_covers_run_eagerly():
    plain, graphed, runner = pair()
    n = ROW_BUCKETS[-1] + 1
    ids, pos = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(0)), torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    a, b = plain.new_arena(1, n), graphed.new_arena(1, n)
    want = plain.packed(ids, pos, [Part(a, 0, pos, causal)])
    got = graphed.packed(ids, pos, [Part(b, 0, pos, causal)])
    assert runner.eager == 1 and runner.replays == 0
    assert torch.equal(got.logits, want.logits)
    own = KVArena(graphed.config.num_layers, 1, graphed.config.num_kv_heads, 8, graphed.config.head_dim,
                  graphed.dtype, graphed.device)  # not the pool's: the graphs cannot read it
    graphed.packed(ids[:1], pos[:1], [Part(own, 0, pos[:1], causal[:1, :1])])
    assert runner.eager == 2 and runner.replays == 0


def test_the_pool_recycles_rows_and_grows_under_live_arenas():
    _, graphed, runner = pair()
    first = graphed.new_arena(1, 100)
    pool = runner.pool
    assert (pool.rows, pool.capacity, first.capacity) == (2, 256, 256)
    first.k[0][0, 0, 5] = 1.0
    second = graphed.new_arena(1, 100)  # rows run out: the pool doubles, the first arena keeps its KV
    assert pool.rows == 3 and pool.generation == 2
    assert first.k[0].data_ptr() == pool.k[0][1].data_ptr() and first.k[0][0, 0, 5].eq(1.0).all()
    third = graphed.new_arena(1, 600)  # a longer request: every row's capacity grows
    assert pool.capacity == 1024 and first.capacity == second.capacity == third.capacity == 1024
    assert first.k[0][0, 0, 5].eq(1.0).all() and pool.rows == 5
    row = pool.row_of(second)
    del second
    gc.collect()
    assert pool.row_of(graphed.new_arena(1, 10)) == row  # a finished request's row serves the next


def test_graphs_are_a_cuda_targets_backend():
    target = from_hf_model(hf_model("llama", seed=3), aux_layer_ids=[1, 2, 3])
    assert not isinstance(target.backend, CudaGraphs)  # auto leaves a CPU target off the graphs
    with pytest.raises(ValueError, match="need a CUDA target"):
        backends.attach(target, "cuda_graphs")
    with pytest.raises(ValueError, match="model.backend"):
        backends.attach(target, "graphs")
    with pytest.raises(ValueError, match="model.backend"):
        ModelConfig(name="x", source="y", aux_layer_ids=[1], backend="always")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_replay_the_eager_decoders():
    plain, graphed, runner = pair("llama", "cuda")
    head = random_head(graphed, seed=5).cuda()
    head_runner = graphed_head(head, graphed)
    tok = CharTokenizer(-1)
    prompt = list(range(3, 40))
    ar = decode_ar(plain, tok, prompt, 32, frozenset())
    assert decode_ar(graphed, tok, prompt, 32, frozenset()).ids == ar.ids
    for drafter in (RandomTree(0), HeadDrafter(head, TreeBudget(topk=3, depth=3, total=8))):
        assert decode_tree(graphed, tok, prompt, 32, frozenset(), drafter, scratch=32).ids == ar.ids
    summary = runner.summary()
    assert summary["captured"] >= 2 and summary["capture_s"] > 0 and head_runner.summary()["captured"] >= 2
