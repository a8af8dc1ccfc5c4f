"""Llama-family building blocks shared by the target model and the EAGLE-3
head: RMSNorm, rotary position embedding, SwiGLU MLP, and attention under an explicit
visibility mask. Numerics follow Hugging Face's Llama (norms and rotary tables in fp32,
cast back to the activation dtype) so logits match ``transformers`` on the same weights.
Pure: imports only torch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D]
    if x.dtype == torch.float32 == weight.dtype:  # one fused kernel, the same formula
        return F.rms_norm(x, weight.shape, weight, eps)
    # in fp32 as transformers does, then cast back before the weight; one call from Python
    # (on a CPU its kernel still runs the ops one by one)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def plain(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection as ``nn.Linear`` computes it (a backend may pass a product of its own)."""
    return linear(x)


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One product for several over the same input (Q/K/V, gate/up): outputs one after another."""
    first = parts[0]
    out = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out.requires_grad_(first.weight.requires_grad)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up: nn.Linear | None = None

    def fuse(self) -> None:
        """Gate and up as one product (``gate_up``); the two projections are dropped."""
        self.gate_up = fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, product: Callable[[nn.Linear, torch.Tensor], torch.Tensor] = plain
                ) -> torch.Tensor:  # [..., H]
        if self.gate_up is not None:
            gate, up = product(self.gate_up, x).chunk(2, dim=-1)
            return product(self.down_proj, F.silu(gate) * up)
        return product(self.down_proj, F.silu(product(self.gate_proj, x)) * product(self.up_proj, x))


class Rotary(nn.Module):
    """cos/sin tables for arbitrary (tree) positions, from a precomputed ``inv_freq``."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, T, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, hd]; cos/sin: [B, T, hd]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(hd/2) * signed_sin(sin)``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in four operations instead of eight, for a forward that prepares its
    tables once; the same products and sum, so the same numbers bit for bit.
    x: [B, heads, T, hd]; cos, sin_signed: [B, 1, T, hd]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def mask_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive bias attention adds to its scores (0 where
    visible, -inf elsewhere): what SDPA makes of a boolean mask in every call, made once."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           blocks: list[tuple[int, int, int]] | None = None, fold_groups: bool = False) -> torch.Tensor:
    """SDPA with grouped KV heads under a visibility mask.

    q: [B, Hq, T, hd]; k, v: [B, Hkv, S, hd]; visible: [B, T, S], boolean (True = may attend)
    or its additive bias in q's dtype (``mask_bias``).
    ``blocks`` (``query_blocks``): query rows [a, b) attend over slots [0, n) only, the same
    result when no row of a block sees a slot at or past its ``n``.
    ``fold_groups``: a one-token query attends as ``Hkv`` heads of ``Hq/Hkv`` rows each (the
    query heads sharing a KV head become that head's rows; their mask is the same row):
    the same attention without SDPA's grouped-head path, which some CPU kernels run several
    times slower for one query row (the eager backend decides by timing).
    """
    gqa = q.shape[1] != k.shape[1]
    if fold_groups and gqa and q.shape[2] == 1:
        b, hq, _, hd = q.shape
        folded = q.reshape(b, k.shape[1], hq // k.shape[1], hd)  # [B, Hkv, G, hd]: head h reads KV head h // G
        return F.scaled_dot_product_attention(folded, k, v, attn_mask=visible[:, None]).reshape(b, hq, 1, hd)
    if blocks is None or len(blocks) == 1 and blocks[0][2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=gqa)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :n], v[:, :, :n],
                                                     attn_mask=visible[:, None, a:b, :n], enable_gqa=gqa)
                      for a, b, n in blocks], dim=2)


def query_blocks(reach: list[int], overhead: int) -> list[tuple[int, int, int]]:
    """Consecutive blocks ``(a, b, n)`` of query rows, rows [a, b) attending over slots [0, n).

    ``reach[i]``: one past the last slot row i sees. Attention under a mask pays for every
    (row, slot) pair up to its width, masked or not, so a call whose rows reach very
    different widths — a prompt's causal rows, SIDE rows far past MAIN's — wastes most of
    it in one call. A block grows while the pairs it pays for beyond its rows' reach stay
    within ``overhead`` (what one more attention call costs, in such pairs).
    """
    blocks: list[tuple[int, int, int]] = []
    start, width, waste = 0, reach[0], 0
    for i in range(1, len(reach)):
        r = reach[i]
        wider = max(width, r)
        more = waste + (wider - width) * (i - start) + (wider - r)
        if more > overhead:
            blocks.append((start, i, width))
            start, width, waste = i, r, 0
        else:
            width, waste = wider, more
    blocks.append((start, len(reach), width))
    return blocks
