"""The runtime against ``transformers`` on random tiny models of each family (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from schemafill.runtime import products
from schemafill.runtime.backends.eager import reach
from schemafill.runtime.layers import apply_rotary, apply_rotary_rolled, attend, query_blocks, signed_sin
from schemafill.runtime.loading import from_hf_model, load_target
from schemafill.runtime.products import KERNELS, PROBE_ROWS, Products, pack, packs, plan_of, room_to_pack
from schemafill.runtime.storage import KVArena

VOCAB = 512


def hf_model(family: str, seed: int = 0, **overrides):
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=False, rope_theta=10000.0, attn_implementation="eager")
    if family == "qwen3":
        settings["head_dim"] = 24  # Qwen3 decouples head_dim from hidden/heads
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**settings, **overrides})).eval()
    with torch.no_grad():  # random biases and norm weights, so a missing one would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def causal(target, ids: torch.Tensor, capacity: int = 64):
    b, t = ids.shape
    arena = target.new_arena(b, capacity)
    pos = torch.arange(t).expand(b, t)
    vis = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    return target(ids, pos, vis, pos, arena), arena


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_and_aux_match_transformers(family, tmp_path):
    model = hf_model(family)
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path, torch.float32, torch.device("cpu"), aux_layer_ids=[1, 2, 4], backend="eager")
    # built without storage, then every tensor taken from the checkpoint or computed
    assert not any(t.is_meta for t in [*target.parameters(), *target.buffers()])
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    out, _ = causal(target, ids)
    assert torch.allclose(out.logits, ref.logits, atol=1e-4), (out.logits - ref.logits).abs().max()
    want = torch.cat([ref.hidden_states[i] for i in (1, 2, 4)], dim=-1)
    assert torch.allclose(out.aux, want, atol=1e-4)


def test_llama3_rope_scaling_and_tied_embeddings_match(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    model = hf_model("llama", tie_word_embeddings=True, rope_scaling=scaling, attention_bias=True)
    target = from_hf_model(model, aux_layer_ids=[0, 1, 2])
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (1, 40))
    pos = torch.arange(100, 140)[None]  # far positions, where llama3 scaling matters
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
    arena = target.new_arena(1, 40)
    vis = torch.ones(40, 40, dtype=torch.bool).tril()[None]
    out = target(ids, pos, vis, torch.arange(40)[None], arena)
    assert torch.allclose(out.logits, ref, atol=1e-4)


def test_incremental_decode_equals_one_pass():
    """Prefill then one token at a time through the arena = one causal pass."""
    target = from_hf_model(hf_model("qwen2", seed=1))
    ids = torch.randint(0, VOCAB, (1, 12))
    full, _ = causal(target, ids)
    arena = target.new_arena(1, 32)
    vis = torch.ones(8, 8, dtype=torch.bool).tril()[None]
    target(ids[:, :8], torch.arange(8)[None], vis, torch.arange(8)[None], arena)
    for t in range(8, 12):
        step = target(ids[:, t:t + 1], torch.tensor([[t]]), torch.ones(1, 1, t + 1, dtype=torch.bool),
                      torch.tensor([[t]]), arena)
        assert torch.allclose(step.logits[0, 0], full.logits[0, t], atol=1e-4)


def test_branching_tree_matches_separate_causal_runs():
    """A tree of new tokens scattered over non-contiguous slots: each node's logits equal the
    causal run of its root-to-node path, and no branch sees a sibling."""
    target = from_hf_model(hf_model("qwen3", seed=2))
    prompt = torch.randint(0, VOCAB, (1, 6))
    # tree over the prompt: node -> parent (-1 = the prompt's last token)
    parents = [-1, 0, 0, 1, 2, -1, 5]
    tokens = torch.randint(0, VOCAB, (len(parents),))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    arena = target.new_arena(1, 40)
    vis = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    target(prompt, torch.arange(6)[None], vis, torch.arange(6)[None], arena)
    slots = torch.tensor([30, 11, 25, 17, 9, 20, 33])  # scratch slots in no particular order
    n = len(parents)
    visible = torch.zeros(n, 40, dtype=torch.bool)
    visible[:, :6] = True
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, slots[j]] = True
            j = parents[j]
    out = target(tokens[None], torch.tensor([6 + d for d in depth])[None], visible[None], slots[None], arena)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(tokens[j]))
            j = parents[j]
        ref, _ = causal(target, torch.cat([prompt[0], torch.tensor(path)])[None])
        assert torch.allclose(out.logits[0, i], ref.logits[0, -1], atol=1e-4), i


def test_batched_rows_and_logits_at():
    """Rows of different lengths in one call, logits gathered per row, rows addressed by index."""
    target = from_hf_model(hf_model("mistral", seed=3))
    a, b = torch.randint(0, VOCAB, (9,)), torch.randint(0, VOCAB, (5,))
    arena = target.new_arena(3, 16)
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, :5] = a, b
    lens = torch.tensor([9, 5])
    pos = torch.arange(9).expand(2, 9)
    vis = torch.ones(9, 9, dtype=torch.bool).tril()[None] & (torch.arange(9) < lens[:, None])[:, None, :]
    out = target(ids, pos, vis, pos, arena, rows=torch.tensor([2, 0]), logits_at=(lens - 1)[:, None])
    for row, seq in ((0, a), (1, b)):
        ref, _ = causal(target, seq[None])
        assert torch.allclose(out.logits[row, 0], ref.logits[0, -1], atol=1e-4)
    assert arena.k[0][1].abs().sum() == 0  # arena row 1 was never written


def test_packed_requests_attend_only_to_their_own_arenas():
    """Three requests in one packed call — a prompt's prefill, a one-token step, a two-node
    tree — each over its own arena: every row's logits and each arena's keys equal what the
    request computes alone, and no request's rows reach another's arena."""
    from schemafill.runtime.calls import Part

    target = from_hf_model(hf_model("llama", seed=4))
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g) for n in (7, 12, 5))
    arenas = [target.new_arena(1, 24) for _ in range(3)]
    causal_rows = lambda n, w: torch.ones(n, w, dtype=torch.bool).tril(w - n)  # noqa: E731
    # b and c have their first tokens in their arenas already
    for arena, seq in ((arenas[1], b[:11]), (arenas[2], c[:4])):
        n = len(seq)
        target(seq[None], torch.arange(n)[None], causal_rows(n, n)[None], torch.arange(n)[None], arena)
    tree = torch.zeros(3, 7, dtype=torch.bool)  # c's last token, then two sibling drafts after it
    tree[:, :5] = True
    tree[1, 5] = tree[2, 6] = True  # each draft sees c and itself, not its sibling
    drafts = torch.randint(0, VOCAB, (2,), generator=g)
    parts = [Part(arenas[0], 0, torch.arange(7), causal_rows(7, 7)),
             Part(arenas[1], 7, torch.tensor([11]), causal_rows(1, 12)),
             Part(arenas[2], 8, torch.tensor([4, 5, 6]), tree)]
    tokens = torch.cat([a, b[11:], c[4:], drafts])
    positions = torch.cat([torch.arange(7), torch.tensor([11]), torch.tensor([4, 5, 5])])
    out = target.packed(tokens, positions, parts, logits_at=torch.tensor([6, 7, 8, 9, 10]))
    refs = [causal(target, seq[None])[0].logits[0, -1] for seq in
            (a, b, c, torch.cat([c, drafts[:1]]), torch.cat([c, drafts[1:]]))]
    for i, ref in enumerate(refs):
        assert torch.allclose(out.logits[0, i], ref, atol=1e-4), i
    _, alone = causal(target, a[None], capacity=24)
    for layer in range(target.config.num_layers):
        assert torch.allclose(arenas[0].k[layer][0, :, :7], alone.k[layer][0, :, :7], atol=1e-5)
        assert arenas[0].k[layer][0, :, 7:].abs().sum() == 0  # nothing else was written there


def test_unsupported_family_is_named():
    from transformers import GPT2Config

    from schemafill.runtime.model import RuntimeConfig

    with pytest.raises(ValueError, match="gpt2"):
        RuntimeConfig.from_hf(GPT2Config())


def test_ragged_spans_equal_one_padded_call():
    target = from_hf_model(hf_model("llama", seed=4))
    arena = target.new_arena(3, 20)
    lens = [12, 4, 9]
    for r, n in enumerate(lens):  # prefill rows of different lengths
        ids = torch.randint(0, VOCAB, (1, n))
        pos = torch.arange(n)[None]
        target(ids, pos, torch.ones(n, n, dtype=torch.bool).tril()[None], pos, arena, rows=torch.tensor([r]))
    step = torch.randint(0, VOCAB, (2, 1))
    pos = torch.tensor([[12], [9]])
    visible = torch.arange(13)[None, None, :] <= pos[..., None]  # [2, 1, 13]
    rows = torch.tensor([0, 2])
    other = KVArena.over([t.clone() for t in arena.k], [t.clone() for t in arena.v])
    padded = target(step, pos, visible, pos, arena, rows=rows)
    ragged = target(step, pos, visible, pos, other, rows=rows, spans=[(0, 13), (2, 10)])
    assert torch.allclose(padded.logits, ragged.logits, atol=1e-5)


# ---------------------------------------------------------------- attention in blocks of rows
def test_query_blocks_split_where_the_reach_jumps():
    # MAIN rows reaching slot ~10, then SIDE rows reaching ~100: two blocks, each at its own width
    assert query_blocks([9, 10, 11, 100, 101], overhead=50) == [(0, 3, 11), (3, 5, 101)]
    # a block grows while its masked-out pairs stay within the overhead: 2 + 1 pairs here
    assert query_blocks([9, 10, 11], overhead=3) == [(0, 3, 11)]
    assert query_blocks([9, 10, 11], overhead=2) == [(0, 2, 10), (2, 3, 11)]
    # a causal prompt of 8 rows at overhead 6: blocks of 4 rows waste 6 pairs each
    assert query_blocks(list(range(1, 9)), overhead=6) == [(0, 4, 4), (4, 8, 8)]
    assert query_blocks([7], overhead=0) == [(0, 1, 7)]


def test_attention_in_blocks_equals_one_call():
    torch.manual_seed(0)
    T, S = 12, 40
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    visible = torch.zeros(1, T, S, dtype=torch.bool)
    for t in range(8):  # causal prompt rows
        visible[0, t, :t + 1] = True
    for t in range(8, T):  # rows that see the prompt and a far region of their own
        visible[0, t, :8] = True
        visible[0, t, 30:31 + t - 8] = True
    blocks = query_blocks(reach(visible), overhead=4)
    assert len(blocks) > 2 and blocks[-1][2] == 34
    assert torch.allclose(attend(q, k, v, visible, blocks), attend(q, k, v, visible), atol=1e-6)


def test_a_forward_attends_in_blocks_and_gives_the_same_logits():
    """A prompt with rows far past it (SIDE-like) in one call, against the same rows as two calls."""
    target = from_hf_model(hf_model("llama", seed=4))
    torch.manual_seed(1)
    P, far = 10, 3000  # far enough that one call's masked-out work outweighs a second call's
    ids = torch.randint(0, VOCAB, (1, P + 2))
    pos = torch.tensor([list(range(P)) + [P, P]])
    slots = torch.tensor([list(range(P)) + [far, far + 1]])
    visible = torch.zeros(1, P + 2, far + 2, dtype=torch.bool)
    visible[0, :P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
    visible[0, P:, :P] = True
    visible[0, P, far] = visible[0, P + 1, far + 1] = True  # two independent continuations
    assert reach(visible) == list(range(1, P + 1)) + [far + 1, far + 2]
    assert len(query_blocks(reach(visible), target.backend.block_overhead)) > 1
    together = target(ids, pos, visible, slots, target.new_arena(1, far + 2))
    arena = target.new_arena(1, far + 2)
    prompt = target(ids[:, :P], pos[:, :P], visible[:, :P, :P], slots[:, :P], arena)
    rest = target(ids[:, P:], pos[:, P:], visible[:, P:], slots[:, P:], arena)
    assert torch.allclose(together.logits, torch.cat([prompt.logits, rest.logits], 1), atol=1e-5)


PACKABLE = torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "packed" or PACKABLE])
def test_every_product_kernel_gives_nn_linear_numbers(kernel, bias):
    """Each product kernel computes ``nn.Linear``'s product, one row (padded to two) and many,
    whatever the leading shape; a plan picks the kernel by row count."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    plan = Products(((4, kernel), (64, "plain")), {layer: pack(layer)} if kernel == "packed" else {})
    for shape in ((1, 1, 24), (1, 3, 24), (2, 2, 24), (5, 24), (1, 9, 24)):
        x = torch.randn(*shape)
        assert torch.allclose(plan(layer, x), layer(x), atol=1e-5)
    assert [plan.kernel(n) for n in (1, 4, 5, 64, 65)] == [kernel, kernel, "plain", "plain", "plain"]


def test_weights_are_packed_only_where_their_copy_leaves_room():
    assert room_to_pack(10, 100) and room_to_pack(50, 100) and room_to_pack(10, None)
    assert not room_to_pack(51, 100) and not room_to_pack(10, 0)


def test_a_plan_merges_runs_and_keeps_the_last_kernel_past_its_end():
    assert plan_of({1: "transposed", 2: "transposed", 4: "packed", 8: "packed", 16: "plain"}) == (
        (2, "transposed"), (8, "packed"), (16, "plain"))
    plan = Products(plan_of({1: "transposed", 8: "packed"}))
    assert [plan.kernel(n) for n in (1, 2, 8, 9, 500)] == ["transposed", "packed", "packed", "packed", "packed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_give_a_row_the_same_numbers_at_any_row_count(dtype):
    """The packed kernel pads a lone row to two, so a row's result does not depend on how many
    rows share the call: bit for bit, as a one-token AR step and a verification need."""
    if not packs(dtype):  # oneDNN packs bf16 only with AVX512 or AVX-NE-CONVERT
        pytest.skip(f"oneDNN does not pack {dtype} weights on this host")
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=True).to(dtype)
    plan = Products(((10**6, "packed"),), {layer: pack(layer)})
    x = torch.randn(70, 96).to(dtype)
    alone = torch.cat([plan(layer, x[i:i + 1]) for i in range(8)])
    for rows in (2, 3, 8, 33, 70):
        assert torch.equal(plan(layer, x[:rows])[:8], alone[:min(rows, 8)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projections_give_the_unfused_logits(family):
    """Q/K/V and gate/up fused into one product each (``Target.fuse``) compute what the
    separate projections did: the logits stay ``transformers``', biases and q/k norms included."""
    model = hf_model(family, seed=4)
    target = from_hf_model(model)
    layer = target.model.layers[0]
    assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    ids = torch.randint(0, VOCAB, (2, 7))
    out, _ = causal(target, ids)
    assert torch.allclose(out.logits, model(ids).logits, atol=1e-4)


def test_a_tuned_target_records_its_plan_and_reads_it_back_from_the_cache(tmp_path):
    """``products.tuned`` times every kernel at each probed row count, gives every projection the
    same plan (whatever it picks, the logits stay ``transformers``'), caches the timings, and a
    second load reads the cache instead of timing; a damaged or incomplete entry is measured again."""
    model = hf_model("llama", seed=2)
    target = from_hf_model(model, backend="eager")
    tuned = products.tuned(target.linears, cache_dir=tmp_path)
    assert tuned.plan and {k for _, k in tuned.plan} <= set(KERNELS)
    (entry,) = tmp_path.glob("*.json")
    saved = json.loads(entry.read_text())
    assert sorted(map(int, saved["timings"])) == list(PROBE_ROWS)
    packed_used = any(k == "packed" for _, k in tuned.plan)
    assert set(tuned.packed) == (set(target.linears) if packed_used else set())
    for plan in (((10**6, "plain"),), ((10**6, "transposed"),)) + ((((1, "transposed"), (10**6, "packed")),)
                                                                    if packed_used else ()):
        target.backend.products = Products(plan, tuned.packed)
        ids = torch.randint(0, VOCAB, (1, 6))
        out, _ = causal(target, ids)
        assert torch.allclose(out.logits[0], model(ids).logits[0], atol=1e-4)
    # the cached timings decide the next load: make the plain product look fastest everywhere
    saved["timings"] = {r: {**t, "plain": 0.0} for r, t in saved["timings"].items()}
    entry.write_text(json.dumps(saved))
    again = products.tuned(target.linears, cache_dir=tmp_path)
    assert again.plan == ((max(PROBE_ROWS), "plain"),) and not again.packed
    for damaged in ("{not json", json.dumps({"key": saved["key"], "timings": {"1": {"plain": 1.0}}})):
        entry.write_text(damaged)
        assert products.tuned(target.linears, cache_dir=tmp_path).plan
        assert sorted(map(int, json.loads(entry.read_text())["timings"])) == list(PROBE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_attention_folds_grouped_heads_into_rows(dtype):
    """Query heads 2h and 2h+1 read KV head h: folded into that head's two rows, a one-token
    query gives what SDPA's grouped path gives; queries of several tokens are not folded."""
    torch.manual_seed(0)
    q = torch.randn(3, 4, 1, 8).to(dtype)
    k, v = torch.randn(3, 2, 10, 8).to(dtype), torch.randn(3, 2, 10, 8).to(dtype)
    visible = torch.rand(3, 1, 10) > 0.4
    visible[..., 0] = True
    folded = attend(q, k, v, visible, fold_groups=True)
    expanded = attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), visible)  # no GQA at all
    assert torch.allclose(folded.float(), expanded.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.allclose(folded.float(), attend(q, k, v, visible).float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    # the head order matters: swapping the KV heads must change a folded result
    assert not torch.allclose(folded, attend(q, k.flip(1), v.flip(1), visible, fold_groups=True))
    several = torch.randn(1, 4, 3, 8)
    mask = torch.ones(3, 10, dtype=torch.bool)[None]
    assert torch.equal(attend(several, k[:1].float(), v[:1].float(), mask, fold_groups=True),
                       attend(several, k[:1].float(), v[:1].float(), mask))


def test_a_target_tuned_to_fold_decodes_as_transformers():
    """Both of ``tune_attention``'s choices decode token by token (one-token queries, where
    folding applies) to ``transformers``' logits."""
    model = hf_model("llama", seed=3)
    target = from_hf_model(model, backend="eager")
    ids = torch.randint(0, VOCAB, (1, 7))
    expected = model(ids).logits[0]
    for fold in (False, True):
        target.backend.fold = fold
        arena = target.new_arena(1, 16)
        for t in range(7):
            pos = torch.tensor([[t]])
            out = target(ids[:, t:t + 1], pos, torch.arange(t + 1)[None, None] <= t, pos, arena)
            assert torch.allclose(out.logits[0, 0], expected[t], atol=1e-4), (fold, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolled_rotary_is_the_rotate_half_rotary(dtype):
    """``apply_rotary_rolled`` with ``signed_sin`` tables rotates as ``apply_rotary`` does, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8).to(dtype)
    angles = torch.randn(2, 5, 8)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rolled = apply_rotary_rolled(x, cos[:, None], signed_sin(sin)[:, None])
    assert torch.equal(rolled, apply_rotary(x, cos, sin))
    assert not torch.allclose(rolled, apply_rotary_rolled(x, cos[:, None], sin[:, None]))
