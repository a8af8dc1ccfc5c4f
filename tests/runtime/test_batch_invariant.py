"""Batch-invariant attention and forwards: a row's numbers do not depend on what else its call
holds, so a verification row is the same bits as the one-row AR step (in fp32 and bf16)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from schemafill.runtime.backends.batch_invariant import BatchInvariant, Blocked, possible
from schemafill.runtime.calls import causal_visibility
from schemafill.runtime.kernels import batch_invariant as kernels
from schemafill.runtime.layers import RMSNorm, Rotary, apply_rotary_rolled, signed_sin
from schemafill.runtime.loading import from_hf_model
from tests.runtime.test_runtime import VOCAB, hf_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler on this host")
bf16_forwards = pytest.mark.skipif(not possible(torch.bfloat16), reason="oneDNN packs no bf16 weights here")
bf16_products = pytest.mark.skipif(not kernels.products_available(), reason="no 512-bit vectors here")
fp32_forwards = pytest.mark.skipif(not possible(torch.float32), reason="no oneDNN here")
# the kernels' own product, per dtype: bf16 where 512-bit vectors are, fp32 where AVX2 is
OWN_PRODUCTS = [pytest.param(torch.float32, marks=pytest.mark.skipif(
                    not kernels.products_available(torch.float32), reason="no AVX2 here")),
                pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
                    not kernels.products_available(torch.bfloat16), reason="no 512-bit vectors here"))]


def invariant_target(model: torch.nn.Module, dtype: torch.dtype):
    """``model`` in ``dtype`` on the batch-invariant backend (an fp32 one asked for by name:
    a target that only generates batches takes eager under ``auto``)."""
    return from_hf_model(model.to(dtype), backend="batch_invariant")

HQ, HKV = 6, 2


def arena(hd: int, capacity: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HKV, capacity, hd, generator=g).to(dtype), torch.randn(HKV, capacity, hd, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128, 24])
def test_the_kernel_is_attention(dtype, hd):
    k, v = arena(hd, 90, dtype, 0)
    q = torch.randn(1, HQ, 7, hd).to(dtype)
    visible = torch.rand(1, 7, 80) < 0.6
    visible[..., 3] = True
    out = kernels.attend(q, [k], [v], visible)
    ref = F.scaled_dot_product_attention(q.float(), k[None, :, :80].float(), v[None, :, :80].float(),
                                         attn_mask=visible[:, None], enable_gqa=True)
    assert out.dtype == dtype and out.shape == (1, HQ, 7, hd)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_arena_writes_and_attention_in_one_call(dtype):
    """``rope_attend`` = rotary as the layers do it, the new keys and values written to their
    slots, then attention; the arena holds what the ordinary path would have written."""
    hd, t = 64, 5
    keys, values = arena(hd, 40, dtype, 5)
    k_ref, v_ref = keys.clone(), values.clone()
    q, k, v = (torch.randn(1, h, t, hd).to(dtype) for h in (HQ, HKV, HKV))
    cos, sin = Rotary(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))(torch.arange(20, 25)[None], dtype)
    cos, sin = cos[:, None], signed_sin(sin)[:, None]
    slots = torch.tensor([[30, 31, 33, 36, 37]])
    visible = torch.rand(1, t, 38) < 0.7
    visible[0, torch.arange(t), slots[0]] = True
    out = kernels.rope_attend(q, k, v, cos, sin, slots, [keys], [values], visible)
    qr, kr = apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin)
    k_ref[:, slots[0]], v_ref[:, slots[0]] = kr[0], v[0]
    assert torch.equal(keys, k_ref) and torch.equal(values, v_ref)
    assert torch.equal(out, kernels.attend(qr, [keys], [values], visible))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128, 24])
def test_a_row_gets_the_same_bits_alone_and_among_many(dtype, hd):
    """A row alone or among a few (a decoding step, a small tree: slots side by side where the
    head dimension allows, else a narrow or a row block) gets the bits it gets among 120 rows a
    KV head (row blocks of 16), whatever the call's reach."""
    k, v = arena(hd, 300, dtype, 1)
    q = torch.randn(1, HQ, 40, hd).to(dtype)
    visible = torch.rand(1, 40, 290) < 0.8
    visible[..., 0] = True
    together = kernels.attend(q, [k], [v], visible)
    for start, n in ((0, 1), (5, 1), (39, 1), (3, 2), (7, 5), (20, 11), (8, 32)):  # 3 to 96 rows a KV head
        rows = slice(start, start + n)
        reach = int(visible[0, rows].nonzero()[:, 1].max()) + 1
        few = kernels.attend(q[:, :, rows], [k], [v], visible[:, rows, :reach])
        assert torch.equal(few, together[:, :, rows]), (start, n)
    assert not torch.equal(together[:, :, 0], together[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_slots_between_the_seen_ones_change_nothing(dtype):
    """A tree row's ancestors sit past slots it does not see (its siblings): the same keys in
    the same order with unseen slots between them give the same bits."""
    k, v = arena(64, 200, dtype, 2)
    q = torch.randn(1, HQ, 1, 64).to(dtype)
    seen = torch.arange(100)
    packed = kernels.attend(q, [k], [v], torch.ones(1, 1, 100, dtype=torch.bool))
    spread = seen + torch.arange(100) // 9  # a gap after every ninth key
    k2, v2 = torch.randn_like(k.float()).to(dtype), torch.randn_like(v.float()).to(dtype)  # unseen slots hold noise
    k2[:, spread], v2[:, spread] = k[:, seen], v[:, seen]
    mask = torch.zeros(1, 1, int(spread[-1]) + 1, dtype=torch.bool)
    mask[0, 0, spread] = True
    assert torch.equal(kernels.attend(q, [k2], [v2], mask), packed)


def test_batch_rows_read_their_own_arena_rows():
    k0, v0 = arena(64, 50, torch.float32, 3)
    k1, v1 = arena(64, 50, torch.float32, 4)
    q = torch.randn(2, HQ, 3, 64)
    visible = torch.ones(2, 3, 40, dtype=torch.bool)
    both = kernels.attend(q, [k0, k1], [v0, v1], visible)
    assert torch.equal(both[1:], kernels.attend(q[1:], [k1], [v1], visible[1:]))
    assert torch.equal(both[:1], kernels.attend(q[:1], [k0], [v0], visible[:1]))


# (family, overrides, chain length): head dims 16 and 24 take row lanes in every call; 32 lets a
# KV head's few rows take slots side by side, its 60-token tree too many (row blocks)
FORWARDS = [("llama", {}, 9), ("qwen2", {}, 9), ("qwen3", {}, 9), ("llama", {"hidden_size": 128}, 30)]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=fp32_forwards),
                                   pytest.param(torch.bfloat16, marks=bf16_forwards)])
@pytest.mark.parametrize("family, overrides, n", FORWARDS, ids=["llama", "qwen2", "qwen3", "llama-hd32"])
def test_a_tree_row_is_the_ar_step_bit_for_bit(family, overrides, n, dtype):
    """The whole forward: AR steps one token at a time against one call holding the same
    chain interleaved with siblings at the same positions (slots the chain does not see)."""
    target = invariant_target(hf_model(family, seed=11, **overrides), dtype)
    assert isinstance(target.backend, BatchInvariant) and target.dtype == dtype
    rng = random.Random(0)
    prompt, chain = [rng.randrange(VOCAB) for _ in range(37)], [rng.randrange(VOCAB) for _ in range(n)]
    p, width = len(prompt), len(prompt) + 2 * len(chain)

    def prefilled():
        a = target.new_arena(1, width)
        pos = torch.arange(p)[None]
        target.forward(torch.tensor([prompt]), pos, causal_visibility(pos, width), pos, a)
        return a

    a = prefilled()
    steps = []
    for i, t in enumerate(chain):
        pos = torch.tensor([[p + i]])
        steps.append(target.forward(torch.tensor([[t]]), pos, causal_visibility(pos, width), pos, a).logits[0, 0])
    tokens, positions, slots = [], [], []
    for i, t in enumerate(chain):  # node i at slot p + 2i, a sibling of it at p + 2i + 1
        tokens += [t, (t + 1) % VOCAB]
        positions += [p + i, p + i]
        slots += [p + 2 * i, p + 2 * i + 1]
    visible = torch.zeros(1, len(tokens), width, dtype=torch.bool)
    visible[0, :, :p] = True
    for r, s in enumerate(slots):
        visible[0, r, [p + 2 * j for j in range(r // 2)] + [s]] = True
    tree = target.forward(torch.tensor([tokens]), torch.tensor([positions]), visible, torch.tensor([slots]), prefilled())
    for i, step in enumerate(steps):
        assert torch.equal(tree.logits[0, 2 * i], step), (family, i)


@fp32_forwards
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_batch_invariant_fp32_forward_is_transformers(family):
    """The batch-invariant path (rotary, arena writes and attention in one call) in fp32, where
    nothing rounds an error away, against transformers' own forward. (These random models
    attend mostly to each token itself, so the rotary is checked by the kernel test above.)"""
    model = hf_model(family, seed=5)
    tokens = torch.tensor([[random.Random(1).randrange(VOCAB) for _ in range(30)]])
    with torch.no_grad():
        ref = model(tokens).logits[0]
    invariant = from_hf_model(model, backend="batch_invariant")
    arena = invariant.new_arena(1, 30)
    pos = torch.arange(30)[None]
    torch.testing.assert_close(invariant.forward(tokens, pos, causal_visibility(pos, 30), pos, arena).logits[0], ref,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_residual_add_and_norm_rounds_as_torch_does(dtype):
    x, y = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    s, h = kernels.add_rms_norm(x, y, norm.weight, 1e-5)
    assert torch.equal(s, x + y) and h.dtype == dtype
    # bf16: at most one rounding apart; fp32: the sum of squares in another order
    torch.testing.assert_close(h, norm(x + y), atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    alone, h0 = kernels.add_rms_norm(x, None, norm.weight, 1e-5)
    assert torch.equal(alone, x) and torch.equal(h0[3], kernels.add_rms_norm(x[3:4], None, norm.weight, 1e-5)[1][0])


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (100, 38), (7, 1536)])
def test_the_product_is_the_product(out_features, in_features, dtype):
    """Against the fp32 product of the same numbers in float64: bf16 one rounding of the result
    apart, fp32 a sum in another order apart (widths that fill whole groups of columns, and ones
    that leave the last group ragged)."""
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(11, in_features, generator=g).to(dtype)
    for b in (None, bias):
        y = kernels.product(x, kernels.pack(w, b))
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert y.dtype == dtype and y.shape == (11, out_features)
        tolerance = {"atol": 1e-5, "rtol": 2 ** -8} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-5}
        torch.testing.assert_close(y.double(), ref, **tolerance)


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
def test_a_row_gets_the_same_product_bits_alone_and_among_many(dtype):
    """Rows are computed a few to a pass and in chunks of 64 sharing the weights: every way of
    cutting the call gives each row the same bits, as do strided inputs. Inputs of mixed
    magnitudes, so that summing in another order would show through the rounding."""
    g = torch.Generator().manual_seed(3)
    w = kernels.pack(torch.randn(200, 576, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype))
    x = (torch.randn(150, 576, generator=g) * 2.0 ** torch.randint(-6, 7, (150, 576), generator=g)).to(dtype)
    together = kernels.product(x, w)
    for start, n in [(r, 1) for r in range(150)] + [(3, 5), (60, 9), (10, 70), (0, 150)]:
        assert torch.equal(kernels.product(x[start:start + n], w), together[start:start + n]), (start, n)
    wide = torch.randn(150, 1000, generator=g).to(dtype)
    wide[:, 100:676] = x
    assert torch.equal(kernels.product(wide[:, 100:676], w), together)


@bf16_products
def test_the_bf16_product_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="even input width"):
        kernels.pack(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 rows of 8"):
        kernels.product(torch.zeros(2, 6, dtype=torch.bfloat16), kernels.pack(torch.zeros(4, 8).bfloat16()))


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
def test_the_products_refuse_what_they_cannot_compute(dtype):
    with pytest.raises(ValueError, match="fp32 weights, not torch.float64"):
        kernels.pack(torch.zeros(4, 8, dtype=torch.float64))
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(ValueError, match=f"takes {dtype} rows of 8"):
        kernels.product(torch.zeros(2, 8, dtype=other), kernels.pack(torch.zeros(4, 8, dtype=dtype)))


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
def test_a_target_runs_its_products_on_the_batch_invariant_kernel(dtype):
    invariant = invariant_target(hf_model("qwen2", seed=2), dtype)  # Q/K/V with a bias
    backend = invariant.backend
    assert isinstance(backend, BatchInvariant) and isinstance(backend.product, Blocked)
    assert set(backend.product.weights) == set(invariant.linears) and backend.product.describe().endswith("blocked")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_rounds_as_torch_does(dtype):
    gu = (torch.randn(9, 2 * 40) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    out = kernels.silu_mul(gu)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
@pytest.mark.parametrize("family, overrides", [("llama", {}), ("qwen2", {}), ("llama", {"hidden_size": 128})],
                         ids=["llama", "qwen2", "llama-hd32"])
def test_one_call_a_layer_is_the_layer_by_layer_forward(family, overrides, dtype):
    """``layer_bf16`` / ``layer_f32`` chain the kernels the layer-by-layer path calls: the same
    logits, features and arena contents bit for bit — batch rows on their own arena rows (one in
    reverse), and a packed call of two requests with a tree, each over its own arena (of its own
    capacity), the two requests' attention run as one loop."""
    from schemafill.runtime.calls import Part

    invariant = invariant_target(hf_model(family, seed=9, **overrides), dtype)
    fused = invariant.backend.layer_calls
    assert fused is not None
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    runs = []
    for calls in (None, fused):
        invariant.backend.layer_calls = calls
        arena = invariant.new_arena(3, 16)
        out = invariant.forward(tokens, pos, causal_visibility(pos, 12), pos + 2, arena, rows=torch.tensor([2, 0]))
        arenas = [invariant.new_arena(1, 16), invariant.new_arena(1, 7)]  # capacities differ: so do their strides
        tree = torch.ones(4, 4, dtype=torch.bool).tril()
        tree[3, 2] = False  # the last two are siblings
        parts = [Part(arenas[0], 0, torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril()),
                 Part(arenas[1], 5, torch.tensor([0, 1, 2, 3]), tree)]
        packed = invariant.packed(tokens[0], torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 2]), parts)
        runs.append((out.logits, out.aux, packed.logits, packed.aux, arena.k, arena.v, arenas[1].k, arenas[1].v))
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, list) else torch.equal(a, b)
    assert runs[1][4][0][0].any() and not runs[1][4][0][1].any()  # arena row 1 stays unwritten


@bf16_forwards
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_batch_invariant_bf16_forward_is_the_model(family):
    """Same bits across calls is worth nothing if the numbers are wrong: the batch-invariant
    bf16 forward against the fp32 transformers model, as close as bf16 gets (transformers' own
    bf16 forward's distance is the yardstick)."""
    model = hf_model(family, seed=5)
    tokens = torch.tensor([[random.Random(1).randrange(VOCAB) for _ in range(30)]])
    with torch.no_grad():
        ref = model(tokens).logits[0]  # [T, V] fp32
        yardstick = (copy.deepcopy(model).to(torch.bfloat16)(tokens).logits[0].float() - ref).abs().max()
    invariant = from_hf_model(copy.deepcopy(model).to(torch.bfloat16))
    assert isinstance(invariant.backend, BatchInvariant)
    arena = invariant.new_arena(1, 30)
    pos = torch.arange(30)[None]
    ours = (invariant.forward(tokens, pos, causal_visibility(pos, 30), pos, arena).logits[0] - ref).abs().max()
    assert ours <= 2 * yardstick, (family, float(ours), float(yardstick))


@fp32_forwards
def test_the_cost_curve_of_a_batch_invariant_target_is_its_own():
    """A cached cost curve is keyed by the kernels it timed: the batch-invariant build is part of it."""
    from infer.pricing.cost_model import host_key

    model = hf_model("llama", seed=1)
    plain = from_hf_model(model, backend="eager")
    invariant = from_hf_model(model, backend="batch_invariant")
    key = host_key(invariant, invariant.device, invariant.dtype)
    assert kernels.build_id() in key and "batch_invariant" in key
    assert kernels.build_id() not in host_key(plain, plain.device, plain.dtype)


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
def test_a_write_past_the_arena_is_refused_not_made(dtype):
    # arenas of two rows: a one-row arena may come from the target's stock with room to spare
    invariant = invariant_target(hf_model("llama", seed=3), dtype)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="arena holds 6"):
        invariant.forward(torch.zeros(1, 4, dtype=torch.long), pos, causal_visibility(pos, 4), pos + 3,
                      invariant.new_arena(2, 6))
    invariant.backend.layer_calls = None  # the layer-by-layer path checks the same
    with pytest.raises(ValueError, match="arena holds 6"):
        invariant.forward(torch.zeros(1, 4, dtype=torch.long), pos, causal_visibility(pos, 4), pos + 3,
                      invariant.new_arena(2, 6))


@pytest.mark.parametrize("dtype", OWN_PRODUCTS)
def test_a_draft_head_beside_a_batch_invariant_target_runs_on_the_kernels_product(dtype):
    """The head's projections (fc, its layer, its LM head) on the kernels' product: the same
    drafts as ``nn.Linear``'s to rounding, every projection packed."""
    from schemafill.runtime.layers import plain
    from tests.decoders.test_decoders import random_head

    model = hf_model("llama", seed=4)
    target = from_hf_model(model.to(dtype), aux_layer_ids=[1, 2, 3], backend="batch_invariant")
    target.hf_config = model.config
    head = random_head(target, seed=2).to(dtype)
    product = target.runs_on().head_product(head)
    assert isinstance(product, Blocked)
    assert set(product.weights) == {m for m in head.modules() if isinstance(m, torch.nn.Linear)}
    aux = torch.randn(5, 3 * model.config.hidden_size).to(dtype)
    runs = []
    for chosen in (plain, product):
        head.product = chosen
        hidden = head.features(aux)[None]  # [1, 5, H]
        pos = torch.arange(5)[None]
        out = head.decode_step(torch.arange(5)[None], hidden, pos, causal_visibility(pos, 5), pos, head.new_arena(5))
        runs.append(head.logits(out).float())
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(runs[1], runs[0], **tolerance)
    assert not torch.equal(runs[0], torch.zeros_like(runs[0]))
