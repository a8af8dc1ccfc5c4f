"""Llama-family building blocks shared by the runtime's target forward and the EAGLE-3
head: RMSNorm, rotary position embedding, SwiGLU MLP, and attention under an explicit
visibility mask. Numerics follow Hugging Face's Llama (norms and rotary tables in fp32,
cast back to the activation dtype) so logits match ``transformers`` on the same weights.
Pure: imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` that can compute a few rows as ``(W @ xᵀ)ᵀ``. On some CPUs the BLAS runs a
    2-16-row product through a kernel that costs far more than one row's (a verification of
    four tokens then costs 1.5 AR steps); the transposed product streams the weights once.
    ``few_rows`` (0: never) is set from a timed probe (``schemafill.runtime.tune_few_rows``)."""

    few_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., In] -> [..., Out]
        rows = x.numel() // x.shape[-1]
        if 1 < rows <= self.few_rows:
            y = (self.weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           blocks: list[tuple[int, int, int]] | None = None, fold_groups: bool = False) -> torch.Tensor:
    """SDPA with grouped KV heads under a boolean visibility mask.

    q: [B, Hq, T, hd]; k, v: [B, Hkv, S, hd]; visible: [B, T, S] (True = may attend).
    ``blocks`` (``query_blocks``): query rows [a, b) attend over slots [0, n) only, the same
    result when no row of a block sees a slot at or past its ``n``.
    ``fold_groups``: a one-token query attends as ``Hkv`` heads of ``Hq/Hkv`` rows each (the
    query heads sharing a KV head become that head's rows; their mask is the same row):
    the same attention without SDPA's grouped-head path, which some CPU kernels run several
    times slower for one query row (``runtime.tune_attention`` decides by timing).
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
