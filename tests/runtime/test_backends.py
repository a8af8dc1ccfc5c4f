"""The backends behind one call interface: each gives ``transformers``' numbers, the decoders
stay lossless on each, ``auto`` chooses by what the host has and measures, and the compiled
backend compiles a layer's worth once for every layer."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tests.conftest import decode_ar, decode_tree
from tests.decoders.test_decoders import CharTokenizer, RandomTree, random_head
from tests.runtime.test_runtime import VOCAB, hf_model

from infer.proposers.head import HeadDrafter, TreeBudget
from schemafill.config import BACKENDS
from schemafill.runtime import backends
from schemafill.runtime.backends import batch_invariant, compiled, cuda_graphs
from schemafill.runtime.calls import Part, causal_visibility
from schemafill.runtime.loading import from_hf_model
from schemafill.runtime.model import sharing

ON_THIS_HOST = ["eager", "compiled", "cuda_graphs"] + (["batch_invariant"] if batch_invariant.possible(torch.float32)
                                                       else [])


def on(name: str, model, aux=(1, 2, 3)):
    """A target sharing ``model``'s weights on backend ``name`` (the graphs' padded calls run eagerly on a CPU)."""
    target = from_hf_model(model, aux_layer_ids=list(aux), backend="eager")
    if name == "cuda_graphs":
        target.backend = cuda_graphs.build(target, target.backend, capture=torch.cuda.is_available())
    elif name != "eager":
        backends.attach(target, name)
    return target


def test_the_config_names_every_backend_and_auto():
    assert set(BACKENDS) == {"auto", *backends.BUILDERS}


@pytest.mark.parametrize("name", ON_THIS_HOST)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_backend_gives_transformers_logits_in_both_call_shapes(name, family):
    model = hf_model(family, seed=6)
    target = on(name, model)
    assert target.backend.name == name and target.backend.summary()["backend"] == name
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    pos = torch.arange(20)[None]
    arena = target.new_arena(1, 32)
    rows = target(ids[:, :12], pos[:, :12], causal_visibility(pos[:, :12], 32), pos[:, :12], arena)
    packed = target.packed(ids[0, 12:], pos[0, 12:], [Part(arena, 0, pos[0, 12:], causal_visibility(pos[:, 12:], 20)[0])])
    logits = torch.cat([rows.logits, packed.logits], dim=1)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    aux = torch.cat([rows.aux, packed.aux], dim=1)
    torch.testing.assert_close(aux, torch.cat([ref.hidden_states[i] for i in (1, 2, 3)], -1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoders_on_the_compiled_backend_equal_its_ar(family):
    """Lossless on the backend it runs: random trees and an EAGLE-3 head over compiled calls give
    the compiled AR's tokens, which are the eager AR's here."""
    model = hf_model(family, seed=7)
    target, plain = on("compiled", model), on("eager", model)
    head = random_head(target, seed=5)
    tok, rng = CharTokenizer(-1), random.Random(3)
    for case in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))]
        ar = decode_ar(target, tok, prompt, 24, frozenset())
        assert ar.ids == decode_ar(plain, tok, prompt, 24, frozenset()).ids
        for drafter in (RandomTree(case), HeadDrafter(head, TreeBudget(topk=3, depth=3, total=8))):
            assert decode_tree(target, tok, prompt, 24, frozenset(), drafter, scratch=32).ids == ar.ids, case


def test_the_compiled_backend_compiles_a_layers_worth_once_for_every_layer():
    """The weights are the compiled functions' arguments: a five-layer target decoding one row
    and trees of a few sizes compiles a graph per function and row class, not per layer."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    target = on("compiled", hf_model("llama", seed=8))
    tok = CharTokenizer(-1)
    decode_tree(target, tok, list(range(5, 30)), 16, frozenset(), RandomTree(0), scratch=32)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs < target.config.num_layers * 3, graphs


def test_auto_chooses_by_device_dtype_and_a_cached_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = hf_model("llama", seed=9)
    generating = from_hf_model(model)  # a target that generates batches: no decode probe
    assert generating.backend.name == "eager" and not (tmp_path / "schemafill" / "backends").exists()
    target = from_hf_model(model, backend="eager")
    if not compiled.Compiled(target, target.backend).covers(1):  # this host's one-row product is oneDNN's packed one
        assert compiled.choose(target, target.backend).summary()["why"].endswith("no compiled graph holds")
        return
    chosen = compiled.choose(target, target.backend)
    (entry,) = (tmp_path / "schemafill" / "backends").glob("*.json")
    saved = json.loads(entry.read_text())
    assert saved["eager_ms"] > 0 and saved["compiled_ms"] > 0 and "timed probe" in chosen.summary()["why"]
    assert chosen.name == ("compiled" if saved["compiled_ms"] <= compiled.MARGIN * saved["eager_ms"] else "eager")
    first = compiled.Compiled(target, target.backend).rows
    if chosen.name == "compiled":  # whole calls of more rows were timed, and cover what they won
        assert "extents" in saved and chosen.rows == compiled.widest(first, saved["extents"])
    # the cached timings decide the next load, without timing again
    for compiled_ms, expected in ((0.5 * saved["eager_ms"], "compiled"), (2.0 * saved["eager_ms"], "eager")):
        entry.write_text(json.dumps({**saved, "compiled_ms": compiled_ms}))
        again = from_hf_model(model, backend="eager")
        assert compiled.choose(again, again.backend).name == expected
    for extents, rows in (({"8": [100.0, 50.0], "16": [100.0, 120.0]}, max(first, 8)), ({"8": [100.0, 99.0]}, first)):
        entry.write_text(json.dumps({**saved, "compiled_ms": 0.5 * saved["eager_ms"], "extents": extents}))
        again = from_hf_model(model, backend="eager")
        assert compiled.choose(again, again.backend).rows == rows
    if batch_invariant.possible(torch.bfloat16):
        bf16 = from_hf_model(hf_model("llama", seed=9).to(torch.bfloat16))
        assert bf16.backend.name == "batch_invariant"


@pytest.mark.skipif(not batch_invariant.kernels.products_available(torch.float32), reason="no AVX2 here")
def test_auto_takes_fp32_batch_invariant_forwards_where_a_cached_probe_finds_them_fast(tmp_path, monkeypatch):
    """An fp32 target that decodes: the batch-invariant backend against what ``auto`` would take
    otherwise, timed once and cached; a later load that finds batch-invariant chosen builds
    nothing else, and the margin goes the way the cached timings say."""
    from schemafill.runtime.backends import eager

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = hf_model("llama", seed=9)
    built = []

    def choose():
        target = from_hf_model(model, backend="eager")
        return batch_invariant.choose(target, lambda why: built.append(why) or eager.build(target, why=why))

    chosen = choose()
    (entry,) = (tmp_path / "schemafill" / "backends").glob("*.json")
    saved = json.loads(entry.read_text())
    assert len(built) == 1 and saved["other"] == "eager" and saved["invariant_ms"] > 0 and saved["other_ms"] > 0
    fast = saved["invariant_ms"] <= batch_invariant.MARGIN * saved["other_ms"]
    assert chosen.name == ("batch_invariant" if fast else "eager") and "timed probe" in chosen.summary()["why"]
    for invariant_ms, expected, builds in ((1.04 * saved["other_ms"], "batch_invariant", 0),
                                           (1.06 * saved["other_ms"], "eager", 1)):
        entry.write_text(json.dumps({**saved, "invariant_ms": invariant_ms}))
        before = len(built)
        again = choose()
        assert again.name == expected and len(built) - before == builds
        assert "(cached)" in again.summary()["why"]
    # ``auto`` asks it for an fp32 target that decodes
    entry.write_text(json.dumps({**saved, "invariant_ms": 0.5 * saved["other_ms"]}))
    attached = backends.attach(from_hf_model(model, backend="eager"), "auto", decodes=True).backend
    assert attached.name == "batch_invariant" and attached.summary()["why"].startswith("auto: timed probe (cached)")


def test_compiled_calls_reach_as_many_rows_as_whole_calls_measured_faster():
    assert compiled.widest(4, {}) == 4
    assert compiled.widest(4, {"8": [100.0, 70.0], "16": [150.0, 149.0], "32": [200.0, 100.0]}) == 8  # 32 not reached
    assert compiled.widest(4, {"16": [100.0, 50.0], "8": [100.0, 95.0]}) == 16  # in order of rows; at the margin wins
    assert compiled.widest(4, {"8": [100.0, 96.0]}) == 4
    assert compiled.widest(16, {"8": [100.0, 50.0]}) == 16  # never fewer than the first range


def test_a_compiled_backend_reaching_more_rows_gives_eagers_logits():
    target = from_hf_model(hf_model("llama", seed=8), backend="eager")
    plain = target.backend
    first = compiled.Compiled(target, plain)
    if not first.covers(1):
        pytest.skip("this host's one-row product is oneDNN's packed one: nothing runs compiled")
    rows = first.rows + 8
    wide = compiled.Compiled(target, plain, rows=rows)
    assert wide.covers(rows) and not first.covers(rows) and not wide.covers(rows + 1)
    tokens = torch.randint(0, target.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(rows)[None]
    causal = torch.ones(1, rows, rows, dtype=torch.bool).tril()
    out = [b.forward(tokens, positions, causal, positions, b.new_arena(1, rows)).logits for b in (plain, wide)]
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[1].argmax(-1), out[0].argmax(-1))


def test_a_backend_the_host_cannot_run_is_named():
    model = hf_model("llama", seed=2)
    with pytest.raises(ValueError, match="model.backend"):
        backends.attach(from_hf_model(model, backend="eager"), "fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            from_hf_model(model, backend="cuda_graphs")
    bare = sharing(model)  # weights, no backend yet
    with pytest.raises(RuntimeError, match="no backend"):
        bare.new_arena(1, 8)
