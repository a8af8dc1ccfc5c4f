"""Batch-invariant attention and forwards: a row's numbers do not depend on what else its call
holds, so a verification row is the same bits as the one-row AR step (in bf16 too)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from schemafill import exact_kernels
from schemafill.runtime import causal_visibility, exact_possible, from_hf_model
from tests.core.test_runtime import VOCAB, hf_model

pytestmark = pytest.mark.skipif(not exact_possible(), reason="no C compiler or oneDNN on this host")

HQ, HKV = 6, 2


def arena(hd: int, capacity: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HKV, capacity, hd, generator=g).to(dtype), torch.randn(HKV, capacity, hd, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 24])
def test_the_kernel_is_attention(dtype, hd):
    k, v = arena(hd, 90, dtype, 0)
    q = torch.randn(1, HQ, 7, hd).to(dtype)
    visible = torch.rand(1, 7, 80) < 0.6
    visible[..., 3] = True
    out = exact_kernels.attend(q, [k], [v], visible)
    ref = F.scaled_dot_product_attention(q.float(), k[None, :, :80].float(), v[None, :, :80].float(),
                                         attn_mask=visible[:, None], enable_gqa=True)
    assert out.dtype == dtype and out.shape == (1, HQ, 7, hd)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_among_many(dtype):
    k, v = arena(64, 300, dtype, 1)
    q = torch.randn(1, HQ, 40, 64).to(dtype)
    visible = torch.rand(1, 40, 290) < 0.8
    visible[..., 0] = True
    together = exact_kernels.attend(q, [k], [v], visible)  # rows side by side, sixteen lanes
    for r in (0, 5, 39):
        reach = int(visible[0, r].nonzero().max()) + 1
        alone = exact_kernels.attend(q[:, :, r:r + 1], [k], [v], visible[:, r:r + 1, :reach])  # four lanes, narrower
        assert torch.equal(alone[:, :, 0], together[:, :, r])
    assert not torch.equal(together[:, :, 0], together[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_slots_between_the_seen_ones_change_nothing(dtype):
    """A tree row's ancestors sit past slots it does not see (its siblings): the same keys in
    the same order with unseen slots between them give the same bits."""
    k, v = arena(64, 200, dtype, 2)
    q = torch.randn(1, HQ, 1, 64).to(dtype)
    seen = torch.arange(100)
    packed = exact_kernels.attend(q, [k], [v], torch.ones(1, 1, 100, dtype=torch.bool))
    spread = seen + torch.arange(100) // 9  # a gap after every ninth key
    k2, v2 = torch.randn_like(k.float()).to(dtype), torch.randn_like(v.float()).to(dtype)  # unseen slots hold noise
    k2[:, spread], v2[:, spread] = k[:, seen], v[:, seen]
    mask = torch.zeros(1, 1, int(spread[-1]) + 1, dtype=torch.bool)
    mask[0, 0, spread] = True
    assert torch.equal(exact_kernels.attend(q, [k2], [v2], mask), packed)


def test_batch_rows_read_their_own_arena_rows():
    k0, v0 = arena(64, 50, torch.float32, 3)
    k1, v1 = arena(64, 50, torch.float32, 4)
    q = torch.randn(2, HQ, 3, 64)
    visible = torch.ones(2, 3, 40, dtype=torch.bool)
    both = exact_kernels.attend(q, [k0, k1], [v0, v1], visible)
    assert torch.equal(both[1:], exact_kernels.attend(q[1:], [k1], [v1], visible[1:]))
    assert torch.equal(both[:1], exact_kernels.attend(q[:1], [k0], [v0], visible[:1]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_bf16_tree_row_is_the_ar_step_bit_for_bit(family):
    """The whole forward: AR steps one token at a time against one call holding the same
    chain interleaved with siblings at the same positions (slots the chain does not see)."""
    model = hf_model(family, seed=11).to(torch.bfloat16)
    target = from_hf_model(model)
    assert target.exact and target.dtype == torch.bfloat16
    rng = random.Random(0)
    prompt, chain = [rng.randrange(VOCAB) for _ in range(37)], [rng.randrange(VOCAB) for _ in range(9)]
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
