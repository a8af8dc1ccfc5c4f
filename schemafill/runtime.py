"""The inference runtime: a Llama-family target forward over a preallocated KV arena.

One forward serves every decoder (DESIGN §3): AR, EAGLE-3 trees, SchemaFill's shared tree,
and the batched generation of training continuations. A call takes new tokens, their
positions, the arena slots they are written to, and a visibility mask saying which arena
slots each new token may attend to. New tokens are written into the arena *before*
attention, so "which arena rows and which new tokens may I see" is one boolean mask over
slots; a tree is just new tokens whose masks name their ancestors' slots.

Families: Llama (and SmolLM2), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm). Weights
load from Hugging Face safetensors (sharded or not) with the same parameter names, or are
shared with an in-memory ``transformers`` model. Numerics follow ``transformers`` (norms
and rotary tables in fp32), so fp32 logits match it tightly; SDPA on CPU (fp32) and CUDA
(bf16) through the same code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schemafill import exact_kernels, host_cache
from schemafill.layers import (KERNELS, MLP, Linear, RMSNorm, Rotary, apply_rotary_rolled, attend, mask_bias,
                               query_blocks, signed_sin)
from schemafill.timing import alternating_ms

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# what one more attention call costs on a CPU, in FLOPs of attention work (4 per head dim per
# (row, slot) pair): a call's fixed overhead is worth a few hundred thousand (row, slot) pairs
# of a small model's heads, so blocks are split only where they save more than that
CPU_CALL_FLOPS = 2e6


@dataclass(frozen=True)
class RuntimeConfig:
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: Any, aux_layer_ids: list[int] | None = None) -> "RuntimeConfig":
        family = hf.model_type
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not supported by the runtime; supported: {FAMILIES}")
        layers = hf.num_hidden_layers
        if aux_layer_ids is None:  # DESIGN §3 default: HF hidden_states[i] for i in [2, L//2, L-3]
            aux_layer_ids = [min(2, layers - 1), layers // 2, max(layers - 3, 0)]
        bad = [i for i in aux_layer_ids if not 0 <= i < layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} outside [0, {layers}) for a {layers}-layer target")
        return cls(
            family=family, hidden_size=hf.hidden_size, num_layers=layers, num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps,
            # Qwen2 always carries q/k/v biases; the others say so in `attention_bias`
            qkv_bias=family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=family != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)), qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            aux_layer_ids=tuple(aux_layer_ids),
        )


def rope_tables(hf: Any) -> tuple[torch.Tensor, float]:
    """``inv_freq`` and attention scaling of the target's rotary embedding (any static rope
    type ``transformers`` knows: default, linear, llama3, yarn); the four families share it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf)
    if rotary.rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope type {rotary.rope_type!r} depends on the sequence length; the runtime supports static ones")
    return rotary.inv_freq.detach().float().clone(), float(rotary.attention_scaling)


def causal_visibility(positions: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T, width] visibility of a plain sequence stored at slot = position: a token sees
    every slot up to its own. positions: [B, T]."""
    return torch.arange(width, device=positions.device)[None, None, :] <= positions[..., None]


class KVArena:
    """Preallocated keys and values: per layer ``[rows, kv_heads, capacity, head_dim]``.

    A row is one independent sequence (a request); slots are positions in the arena, not
    token positions: who owns which slot (prompt, committed, branch, scratch) is the
    decoder's business, the arena only stores and serves them.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows, self.capacity = rows, capacity
        self._addresses: torch.Tensor | None = None

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> "KVArena":
        """An arena over per-layer tensors someone else owns (a pool's rows: ``schemafill.graphs``)."""
        arena = cls.__new__(cls)
        arena.k, arena.v = k, v
        arena.rows, arena.capacity = k[0].shape[0], k[0].shape[2]
        arena._addresses = None
        return arena

    def addresses(self) -> torch.Tensor:
        """[layers, 2, rows] int64: where each layer's keys, then values, of each row start (the
        batch-invariant kernels' view of the arena; its tensors never move, so computed once)."""
        if self._addresses is None:
            step = self.k[0].stride(0) * self.k[0].element_size()
            self._addresses = torch.tensor([[[t.data_ptr() + r * step for r in range(self.rows)] for t in (k, v)]
                                            for k, v in zip(self.k, self.v)], dtype=torch.int64)
        return self._addresses

    def write(self, layer: int, rows: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B, T]; k, v: [B, Hkv, T, hd]
        if rows is None and slots.shape[0] == 1:  # one arena row: a copy along slots, no index grid
            self.k[layer][0].index_copy_(1, slots[0], k[0])
            self.v[layer][0].index_copy_(1, slots[0], v[0])
            return
        r = torch.arange(slots.shape[0], device=slots.device) if rows is None else rows
        self.k[layer][r[:, None], :, slots] = k.transpose(1, 2)
        self.v[layer][r[:, None], :, slots] = v.transpose(1, 2)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``n`` slots (a shared prompt prefix)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots ``src`` of ``row`` are copied to ``dst`` (accepted scratch rows joining a
        committed region); the source is gathered first, so overlapping moves are safe."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        device = self.k[0].device
        s = torch.tensor([p[0] for p in pairs], device=device)
        d = torch.tensor([p[1] for p in pairs], device=device)
        for k, v in zip(self.k, self.v):
            k[row, :, d] = k[row, :, s]
            v[row, :, d] = v[row, :, s]

    def read(self, layer: int, rows: torch.Tensor | None, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``span`` slots of the given rows: a view when all rows are read."""
        k, v = self.k[layer][:, :, :span], self.v[layer][:, :, :span]
        if rows is None:
            return k, v
        return k[rows], v[rows]


class Attention(nn.Module):
    fold_groups = False  # one-token queries fold grouped heads into rows (``tune_attention``)

    def __init__(self, c: RuntimeConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv: Linear | None = None

    def fuse(self) -> None:
        """Q, K and V as one product (``qkv``); the three projections are dropped."""
        self.qkv = Linear.fused([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, kv: "ArenaCall | Packed"
                ) -> torch.Tensor:
        # x: [B, T, H]; cos, sin: [B, 1, T, hd], sin with its first half negated (``layers.signed_sin``)
        b, t, _ = x.shape
        hd = self.c.head_dim
        if self.qkv is not None:
            heads = self.qkv(x).view(b, t, -1, hd).transpose(1, 2)  # [B, Hq + 2·Hkv, T, hd]
            q, k, v = heads.split([self.c.num_heads, self.c.num_kv_heads, self.c.num_kv_heads], dim=1)
        else:
            q, k, v = (p(x).view(b, t, -1, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.c.qk_norm:  # over each head's dimensions
            q, k = self.q_norm(q), self.k_norm(k)
        out = kv(layer, q, k, v, cos, sin, self.fold_groups)  # [B, Hq, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def exact_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, kv: "ArenaCall | Packed"
                      ) -> torch.Tensor:
        """``forward`` for a batch-invariant bf16 target (``make_exact``: fused Q/K/V, row-invariant
        products) with none of the generic dispatch around its two products: the per-layer
        Python a one-row step pays for is most of what it spends beside the weights."""
        b, t, _ = x.shape
        c, hd = self.c, self.c.head_dim
        heads = exact_product(self.qkv, x.view(b * t, -1)).view(b, t, -1, hd).transpose(1, 2)
        q, k, v = heads.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = kv(layer, q, k, v, cos, sin, False)  # [B, Hq, T, hd], its transpose contiguous
        return exact_product(self.o_proj, out.transpose(1, 2).reshape(b * t, -1)).view(b, t, -1)


def exact_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:  # [N, In] -> [N, Out]
    """A bf16 product that gives a row the same bits whatever the call's row count: the
    batch-invariant kernels' own where ``make_exact`` laid the weight out for it
    (``Linear.blocked``), else oneDNN's padded packed one."""
    blocked = linear.blocked
    return linear.product(x, "packed") if blocked is None else exact_kernels.product(x, blocked)


def exact_mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
    """``MLP.forward`` for a batch-invariant bf16 target (gate/up fused, row-invariant products)."""
    b, t, _ = x.shape
    act = exact_kernels.silu_mul(exact_product(mlp.gate_up, x.view(b * t, -1)))
    return exact_product(mlp.down_proj, act).view(b, t, -1)


@dataclass(frozen=True)
class ArenaCall:
    """Where a batch-row call's keys and values go and what its tokens attend to
    (``Target.forward``): batch row b writes to arena row ``rows[b]``. Called per layer with
    the new queries, keys and values before rotary: it rotates them, writes keys and values to
    the arena and attends (the batch-invariant kernel does all three in one call)."""

    arena: KVArena
    rows: torch.Tensor | None  # [B] (None: rows 0..B-1)
    slots: torch.Tensor  # [B, T]
    # [B, T, S]: the visibility as an additive bias for SDPA (``layers.mask_bias``), or as
    # booleans for the batch-invariant kernel (``Target.exact``)
    mask: torch.Tensor
    spans: list[tuple[int, int]] | None
    blocks: list[tuple[int, int, int]] | None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, fold: bool) -> torch.Tensor:
        # q: [B, Hq, T, hd]; k, v: [B, Hkv, T, hd]; cos, sin: [B, 1, T, hd] (``Attention.forward``)
        arena, mask = self.arena, self.mask
        if mask.dtype == torch.bool:  # each row reads just the slots it sees, in one call
            rows = range(q.shape[0]) if self.rows is None else self.rows.tolist()
            return exact_kernels.rope_attend(q, k, v, cos, sin, self.slots, [arena.k[layer][r] for r in rows],
                                             [arena.v[layer][r] for r in rows], mask)
        q, k = apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin)
        arena.write(layer, self.rows, self.slots, k, v)
        if self.spans is None:
            keys, values = arena.read(layer, self.rows, mask.shape[-1])  # [B, Hkv, S, hd]
            return attend(q, keys, values, mask, self.blocks, fold)
        # ragged: each row reads only its own slots, straight from the arena
        return torch.cat([attend(q[b:b + 1], arena.k[layer][r:r + 1, :, :n], arena.v[layer][r:r + 1, :, :n],
                                 mask[b:b + 1, :, :n], fold_groups=fold) for b, (r, n) in enumerate(self.spans)])

    def groups(self, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
        """The call as ``layer_group`` arguments: one group of every batch row."""
        rows = range(self.slots.shape[0]) if self.rows is None else self.rows.tolist()
        return [layer_group(self.arena, rows, 0, self.slots, self.mask, cos, sin)]


@dataclass(frozen=True)
class Part:
    """One request's rows of a packed call (``Target.packed``): rows ``[start, start + T)``
    write their keys and values to ``slots`` of the request's own arena (row 0) and attend
    to its slots under ``visibility``; no row sees another request's."""

    arena: KVArena
    start: int
    slots: torch.Tensor  # [T]
    visibility: torch.Tensor  # [T, S]: S ≤ the arena's capacity

    @property
    def stop(self) -> int:
        return self.start + self.slots.shape[0]


@dataclass(frozen=True)
class Packed:
    """The attention of a packed call: each part over its own arena, in query blocks on a CPU."""

    parts: list[Part]
    blocks: list[list[tuple[int, int, int]] | None]
    masks: list[torch.Tensor]  # [1, T, S] per part: its visibility as an additive bias, or booleans (``ArenaCall``)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, fold: bool) -> torch.Tensor:
        # as ``ArenaCall``'s, a batch of one whose rows are the parts' rows one after another
        outs = []
        exact = self.masks[0].dtype == torch.bool
        if not exact:
            q, k = apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin)
        for part, blocks, mask in zip(self.parts, self.blocks, self.masks):
            a, b = part.start, part.stop
            if exact:
                outs.append(exact_kernels.rope_attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cos[:, :, a:b],
                                                      sin[:, :, a:b], part.slots[None], [part.arena.k[layer][0]],
                                                      [part.arena.v[layer][0]], mask))
                continue
            part.arena.write(layer, None, part.slots[None], k[:, :, a:b], v[:, :, a:b])
            keys, values = part.arena.read(layer, None, mask.shape[-1])  # [1, Hkv, S, hd]
            outs.append(attend(q[:, :, a:b], keys, values, mask, blocks, fold))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def groups(self, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
        """The call as ``layer_group`` arguments: one group a part."""
        return [layer_group(p.arena, [0], p.start, p.slots[None], mask, cos[:, :, p.start:p.stop],
                            sin[:, :, p.start:p.stop]) for p, mask in zip(self.parts, self.masks)]


def layer_group(arena: KVArena, rows: list[int], row0: int, slots: torch.Tensor, mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """One attention call of ``exact_kernels.LayerCall`` — batch rows ``rows`` of ``arena``, whose
    tokens are the call's rows from ``row0`` on; slots [B, T]; mask [B, T, S] boolean; cos, sin:
    [B, 1, T, hd] — with the tensors it points into (to keep alive through the layers)."""
    mask, slots = exact_kernels.checked(arena.capacity, mask, slots)
    k0 = arena.k[0]
    kv = arena.addresses()[:, :, rows].contiguous()
    b, t = slots.shape
    group = exact_kernels.AttentionGroup(b, t, mask.shape[-1], row0, slots.data_ptr(), slots.stride(0), kv.data_ptr(),
                                         k0.stride(1), k0.stride(2), mask.data_ptr(), mask.stride(0), mask.stride(1),
                                         cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.stride(2))
    return group, (mask, slots, kv, cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, c: RuntimeConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)


class Backbone(nn.Module):
    """Named like ``transformers``' ``model.*`` so checkpoints load without renaming."""

    def __init__(self, c: RuntimeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclass
class Forward:
    logits: torch.Tensor  # [B, K, V]: at ``logits_at`` (all T positions when not given)
    aux: torch.Tensor  # [B, T, 3·H]: HF hidden_states[i] for i in aux_layer_ids, concatenated
    final: torch.Tensor  # [B, K, H]: the final normed hidden states the logits come from


class Target(nn.Module):
    """The target model as the decoders see it: ``forward(...) -> Forward``."""

    def __init__(self, c: RuntimeConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 hf_config: Any = None) -> None:
        super().__init__()
        self.config = c
        self.hf_config = hf_config  # the transformers config it came from (heads are shaped from it)
        self.model = Backbone(c)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(inv_freq, attention_scaling)
        self.products: tuple[tuple[int, str], ...] = ()  # every projection's kernel plan (``tune_products``)
        self.fold_groups = False  # one-token attention folds grouped heads (``tune_attention``)
        # batch-invariant: a row's logits are the same bits whatever else its call holds
        # (``make_exact``), so verifying in bf16 gives AR's tokens
        self.exact = False
        # per layer, what ``exact_kernels``' one-call layer takes (``make_exact``, where it applies)
        self.layer_calls: list[tuple] | None = None
        # CUDA graphs of its decode and verification calls, and the KV pool they read (``schemafill.graphs``)
        self.graphs: Any = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        if self.graphs is not None and rows == 1:  # a row of the pool its graphs read
            return self.graphs.arena(capacity)
        c = self.config
        return KVArena(c.num_layers, rows, c.num_kv_heads, capacity, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        """tokens, positions, write_slots: [B, T]; visibility: [B, T, S] over arena slots
        0..S-1 (every write slot must be < S, and a token must see its own slot);
        rows: [B] arena rows (default: rows 0..B-1); logits_at: [B, K] indices into T.

        ``spans`` — one ``(arena row, slots)`` per batch row, where no token of that row sees
        a slot at or past ``slots`` — switches attention to one call per row over just its
        own slots. Same result; faster when rows differ in length (batched decoding), where
        one padded call would read every row's KV up to the longest.

        Otherwise, on a CPU, the tokens attend in blocks of rows, each over only the slots its
        rows reach (``layers.query_blocks``): same result, and a call whose rows reach very
        different widths (a prompt's causal rows, SIDE rows far past MAIN's) skips most of
        the masked-out work. A GPU attends in one call: there a launch costs more than the
        masked work it would save, and reading the mask back would stall the launch queue."""
        if self.graphs is not None and tokens.shape[0] == 1 and rows is None and spans is None:
            part = Part(arena, 0, write_slots[0], visibility[0])
            out = self.graphs.packed(tokens[0], positions[0], [part], None if logits_at is None else logits_at[0])
            if out is not None:
                return out
        if self.exact:
            return self._run(tokens, positions, ArenaCall(arena, rows, write_slots, visibility, None, None), logits_at)
        blocks = query_blocks(reach(visibility), self.block_overhead()) \
            if spans is None and visibility.device.type == "cpu" else None
        mask = mask_bias(visibility, self.dtype)  # once, not in every layer's attention
        return self._run(tokens, positions, ArenaCall(arena, rows, write_slots, mask, spans, blocks), logits_at)

    @torch.inference_mode()
    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        """Several requests' rows in one forward: tokens, positions: [N], the parts' rows one
        after another; logits_at: [K] indices into N. Every projection runs once over all N
        rows; each part attends over its own arena (``Part``). Returns a batch of one:
        logits [1, K, V], aux [1, N, 3·H], final [1, K, H]."""
        if self.graphs is not None:
            out = self.graphs.packed(tokens, positions, parts, logits_at)
            if out is not None:
                return out
        cpu = tokens.device.type == "cpu" and not self.exact
        overhead = self.block_overhead()
        blocks = [query_blocks(reach(p.visibility[None]), overhead) if cpu else None for p in parts]
        masks = [p.visibility[None] if self.exact else mask_bias(p.visibility[None], self.dtype) for p in parts]
        return self._run(tokens[None], positions[None], Packed(parts, blocks, masks),
                         None if logits_at is None else logits_at[None])

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, kv: ArenaCall | Packed,
             logits_at: torch.Tensor | None) -> Forward:
        c = self.config
        x = self.model.embed_tokens(tokens)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [B, 1, T, hd], once for every layer
        saved = {}
        if self.layer_calls is not None:  # one call a layer
            final = self._fused(x, cos, sin, kv, saved)
            if logits_at is not None:
                final = final.gather(1, logits_at[..., None].expand(-1, -1, final.shape[-1]))
            logits = exact_product(self.lm_head, final.reshape(-1, final.shape[-1])).view(*final.shape[:2], -1)
        elif self.exact and x.dtype == torch.bfloat16:  # each residual add and the norm after it: one call
            layers = self.model.layers
            x, h = exact_kernels.add_rms_norm(x, None, layers[0].input_layernorm.weight, c.rms_norm_eps)
            for i, layer in enumerate(layers):
                if i in c.aux_layer_ids:
                    saved[i] = x
                x, h = exact_kernels.add_rms_norm(x, layer.self_attn.exact_forward(h, cos, sin, i, kv),
                                                  layer.post_attention_layernorm.weight, c.rms_norm_eps)
                after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                x, h = exact_kernels.add_rms_norm(x, exact_mlp(layer.mlp, h), after.weight, c.rms_norm_eps)
            final = h if logits_at is None else h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))
            logits = exact_product(self.lm_head, final.reshape(-1, final.shape[-1])).view(*final.shape[:2], -1)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in c.aux_layer_ids:
                    saved[i] = x
                x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, i, kv)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            if logits_at is not None:
                x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
            final = self.model.norm(x)
            logits = self.lm_head(final)
        aux = torch.cat([saved[i] for i in c.aux_layer_ids], dim=-1)
        return Forward(logits=logits.float(), aux=aux, final=final)

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: "ArenaCall | Packed",
               saved: dict) -> torch.Tensor:
        """The layers of a batch-invariant bf16 target, each one ``exact_kernels`` call
        (``layer_bf16``: the same kernels in the same order as ``_run``'s calls one by one), so
        the per-layer Python a small call pays for is gone. Returns the final norm [B, T, H]."""
        c = self.config
        layers = self.model.layers
        x, h = exact_kernels.add_rms_norm(x, None, layers[0].input_layernorm.weight, c.rms_norm_eps)
        b, t, width = x.shape
        rows, hd, qw = b * t, c.head_dim, c.num_heads * c.head_dim
        inter = layers[0].mlp.down_proj.in_features
        groups, keep = zip(*kv.groups(cos.contiguous(), sin.contiguous()))
        sizes = [rows * (qw + 2 * c.num_kv_heads * hd), rows * qw, rows * qw, rows * width, rows * 2 * inter,
                 rows * inter]
        scratch = torch.empty(sum(sizes), dtype=torch.bfloat16)
        at = [scratch.data_ptr() + 2 * sum(sizes[:i]) for i in range(len(sizes))]
        table = (exact_kernels.AttentionGroup * len(groups))(*groups)
        call = exact_kernels.LayerCall(rows, width, c.num_heads, c.num_kv_heads, hd, inter, len(groups),
                                       c.rms_norm_eps, hd ** -0.5, table, *at)
        run, xp, hp = exact_kernels.loaded().layer_bf16, x.data_ptr(), h.data_ptr()
        for i, args in enumerate(self.layer_calls):
            if i in c.aux_layer_ids:
                saved[i] = x.clone()
            run(call, i, *args, xp, hp)
        del keep  # what the groups point into lived until here
        return h

    def block_overhead(self) -> int:
        """One more attention call's cost on a CPU in (row, slot) pairs of attention work."""
        return int(CPU_CALL_FLOPS / (4 * self.config.num_heads * self.config.head_dim))


def reach(visibility: torch.Tensor) -> list[int]:
    """[B, T, S] -> per row t, one past the last slot any batch row's token t may see."""
    seen = visibility.any(0)  # [T, S]
    return (seen.shape[-1] - seen.flip(-1).to(torch.uint8).argmax(-1)).tolist()


def _checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} missing: the runtime loads Hugging Face safetensors checkpoints")
        state.update(load_file(str(folder / name)))
    return state


def _install(target: Target, state: dict[str, torch.Tensor]) -> Target:
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if target.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = target.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("rotary.") and not (
        k == "lm_head.weight" and target.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a {target.config.family} runtime: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if target.config.tie_word_embeddings:  # assign=True replaced the shared parameter: tie again
        target.lm_head.weight = target.model.embed_tokens.weight
    return target


def load_target(folder: str | Path, dtype: torch.dtype, device: torch.device,
                aux_layer_ids: list[int] | None = None) -> Target:
    """A runtime target from a local Hugging Face folder (config.json + safetensors)."""
    from transformers import AutoConfig

    folder = Path(folder)
    hf = AutoConfig.from_pretrained(folder)
    tables = rope_tables(hf)
    with torch.device("meta"):  # every parameter is then assigned from the checkpoint: no random init
        target = Target(RuntimeConfig.from_hf(hf, aux_layer_ids), *tables, hf_config=hf)
    state = {k: v.to(dtype) for k, v in _checkpoint_state(folder).items()}
    target = _install(target, state).to(device).eval()
    if target.device.type != "cpu":  # its weights are its own: Q/K/V and gate/up one product each, fewer launches
        fuse(target)
    return tune(target)


def from_hf_model(model: Any, aux_layer_ids: list[int] | None = None) -> Target:
    """A runtime target sharing the parameters of an in-memory ``transformers`` model (on a
    CPU, the fused Q/K/V and gate/up products hold copies: build it after training, not before)."""
    hf = model.config
    target = Target(RuntimeConfig.from_hf(hf, aux_layer_ids), *rope_tables(hf), hf_config=hf)
    state = dict(model.state_dict())
    return tune(_install(target, state).to(next(model.parameters()).device).eval())


# row counts the product probe times; a count between two takes the larger one's kernel
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
TRANSPOSED_ROWS = 16  # past this many rows the transposed product is the plain one


def tune(target: Target, cache_dir: Path | None = None) -> Target:
    """The CPU kernels of a freshly loaded target, after its Q/K/V and gate/up projections
    become one product each (fewer, larger calls): a bf16 target the batch-invariant ones where
    the host has them (``make_exact``: nothing to choose, so no probe), any other the fastest of
    each by a timed probe. A GPU keeps its own kernels (``load_target`` fuses there; a target
    sharing a ``transformers`` model's weights keeps them separate, as fused ones would be copies)."""
    if target.device.type != "cpu":
        return target
    fuse(target)
    if target.dtype == torch.bfloat16 and exact_possible(target.dtype) and make_exact(target).exact:
        return target
    return tune_attention(tune_products(target, cache_dir=cache_dir))


@lru_cache(maxsize=4)
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks ``dtype`` weights here (its bf16 packing needs AVX512 or AVX-NE-CONVERT;
    ``ONEDNN_MAX_CPU_ISA`` may withhold them): tried on a small weight."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def exact_possible(dtype: torch.dtype) -> bool:
    """Whether this host can run batch-invariant ``dtype`` forwards (``make_exact``): the
    batch-invariant kernels (a C compiler), with their own bf16 products (512-bit vectors) or
    oneDNN's packed ones in that dtype."""
    if not exact_kernels.available():
        return False
    return dtype == torch.bfloat16 and exact_kernels.products_available() or packs(dtype)


def make_exact(target: Target) -> Target:
    """Batch-invariant forwards: every product row-invariant — in bf16 the batch-invariant
    kernels' own over a blocked copy of the weight (``exact_kernels.product``) where the host
    has it, else oneDNN's padded packed kernel — attention on the batch-invariant kernel
    (``exact_kernels``), with rotary and the KV writes, and each residual add with its norm;
    the MLP's activation is row-wise already. A row's logits are then the same bits in a
    one-row AR step and in a tree verification, in bf16 as in fp32. Costs the plan's other
    kernels where they were faster. Q/K/V and gate/up are fused first: the layers call those
    products directly. Without room for the weights' copies the target is left as it was (not exact)."""
    if not exact_possible(target.dtype):
        raise RuntimeError(f"no batch-invariant {target.dtype} forward on this host (it needs a C compiler, and "
                           f"512-bit vectors or oneDNN packing of {target.dtype} weights)")
    linears = [m for m in fuse(target).modules() if isinstance(m, Linear)]
    blocked = target.dtype == torch.bfloat16 and exact_kernels.products_available() and all(
        m.in_features % 2 == 0 for m in linears)
    if all(m.packed is None and m.blocked is None for m in linears) and not room_to_pack(
            sum(m.weight.numel() * m.weight.element_size() for m in linears), available_memory()):
        print("[runtime] no room for packed weights: forwards stay batch-variant (verify in fp32)")
        return target
    kernel = "blocked" if blocked else "packed"
    for m in linears:
        if blocked:
            m.blocked, m.packed, m.plan = m.blocked or exact_kernels.pack(m.weight, m.bias), None, ()
        else:
            if m.packed is None:
                m.pack()
            m.plan = ((PROBE_ROWS[-1], "packed"),)
    target.products = ((PROBE_ROWS[-1], kernel),)
    target.exact = True
    if blocked and not target.config.qk_norm:  # one call a layer (the kernels have no Q/K norms)
        layers = target.model.layers
        after = [layer.input_layernorm for layer in layers[1:]] + [target.model.norm]
        target.layer_calls = [(layer.self_attn.qkv.blocked.args, layer.self_attn.o_proj.blocked.args,
                               layer.mlp.gate_up.blocked.args, layer.mlp.down_proj.blocked.args,
                               layer.post_attention_layernorm.weight.data_ptr(), norm.weight.data_ptr())
                              for layer, norm in zip(layers, after)]
    return target


def fuse(target: Target) -> Target:
    """Q/K/V and gate/up as one product each, in every layer (their weights are copied, so a
    target that will be trained is not fused)."""
    for layer in target.model.layers:
        if layer.self_attn.qkv is None:
            layer.self_attn.fuse()
        if layer.mlp.gate_up is None:
            layer.mlp.fuse()
    return target


def plan_of(choices: dict[int, str]) -> tuple[tuple[int, str], ...]:
    """The kernel plan from the fastest kernel per probed row count: runs of one kernel merged;
    a row count past the last probed one keeps the last kernel."""
    plan: list[tuple[int, str]] = []
    for rows in sorted(choices):
        if plan and plan[-1][1] == choices[rows]:
            plan[-1] = (rows, choices[rows])
        else:
            plan.append((rows, choices[rows]))
    return tuple(plan)


def products_key(target: Target, linears: list[Linear], packable: bool) -> str:
    """What the product probe's timings depend on: every projection's shape, the dtype, whether
    the packed kernel is in the running, the host (CPU model, cores, threads, ISA caps) and the
    torch build."""
    from schemafill.precision import cpu_model

    shapes = sorted({(m.out_features, m.in_features) for m in linears})
    return "|".join([json.dumps(shapes), f"x{len(linears)}", str(target.dtype), f"packed{int(packable)}",
                     cpu_model(), str(os.cpu_count()), f"threads{torch.get_num_threads()}",
                     torch.backends.cpu.get_cpu_capability(), os.environ.get("ATEN_CPU_CAPABILITY", ""),
                     os.environ.get("ONEDNN_MAX_CPU_ISA", ""), f"torch{torch.__version__}"])


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable, else the free pages; None where
    the OS says neither)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def room_to_pack(weight_bytes: int, available: int | None, share: float = 0.5) -> bool:
    """Whether the packed kernel's copies of the weights (as many bytes again) fit in ``share``
    of the free memory: a target near the host's memory keeps the kernels that need no copy."""
    return available is None or weight_bytes <= share * available


@torch.inference_mode()
def probe_products(linears: list[Linear], kernels: tuple[str, ...], repeats: int = 3) -> dict[int, dict[str, float]]:
    """Milliseconds of all of a target's projections (each over its own weights, so they
    stream from memory as in a forward) at each of ``PROBE_ROWS``, per kernel, kernels timed
    in turn."""
    weight = linears[0].weight
    g = torch.Generator().manual_seed(0)
    timings: dict[int, dict[str, float]] = {}
    for rows in PROBE_ROWS:
        inputs = {n: torch.randn(rows, n, generator=g).to(weight.dtype) for n in {m.in_features for m in linears}}
        names = kernels_at(rows, kernels)

        def sweep(kernel: str) -> None:
            for m in linears:
                m.product(inputs[m.in_features], kernel)

        ms = alternating_ms([lambda k=k: sweep(k) for k in names], weight.device, repeats)
        timings[rows] = dict(zip(names, ms))
    return timings


def kernels_at(rows: int, kernels: tuple[str, ...]) -> list[str]:
    """The kernels worth timing at ``rows`` rows."""
    return [k for k in kernels if k != "transposed" or rows <= TRANSPOSED_ROWS]


def complete(timings: dict[int, dict[str, float]], kernels: tuple[str, ...]) -> bool:
    """Whether cached timings cover every probed row count with every kernel worth timing there."""
    return sorted(timings) == list(PROBE_ROWS) and all(set(kernels_at(rows, kernels)) <= set(t)
                                                      for rows, t in timings.items())


def tune_products(target: Target, cache_dir: Path | None = None) -> Target:
    """Time the target's own projections at 1-128 rows with each product kernel
    (``layers.Linear``) and give every projection the fastest per row count (``Target.products``).
    A few seconds, cached per host and shape like the precision probe. A GPU keeps its own kernels."""
    if target.device.type != "cpu":
        return target
    linears = [m for m in target.modules() if isinstance(m, Linear)]
    packable = packs(target.dtype)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if packable and not room_to_pack(weight_bytes, available_memory()):
        print(f"[runtime] {weight_bytes / 1e9:.1f} GB of weights: no room for their packed copies, "
              f"so the products use the kernels that need none")
        packable = False
    kernels = KERNELS if packable else tuple(k for k in KERNELS if k != "packed")
    if packable:
        for m in linears:
            m.pack()
    key = products_key(target, linears, packable)
    path = host_cache.entry(cache_dir or host_cache.folder("products"), key)
    saved = host_cache.read(path, key)
    try:
        timings = {int(r): {k: float(ms) for k, ms in t.items()} for r, t in saved["timings"].items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        timings = None  # no entry, or a damaged one
    if timings is None or not complete(timings, kernels):
        timings = probe_products(linears, kernels)
        host_cache.write(path, key, {"timings": timings}, "the product probe")
    plan = plan_of({rows: min((k for k in t if k in kernels), key=t.get) for rows, t in timings.items()})
    keep_packed = any(kernel == "packed" for _, kernel in plan)
    for m in linears:
        m.plan = plan
        if not keep_packed:
            m.packed = None
    target.products = plan
    return target


@torch.inference_mode()
def tune_attention(target: Target, margin: float = 0.9, repeats: int = 5, context: int = 512,
                   requests: int = 8) -> Target:
    """Time one decoding step of ``requests`` one-token requests, each over its own arena of
    ``context`` slots (a batched round's attention calls, one per request and layer, between the
    weights the forward streams), with SDPA's grouped-head path and folded into KV-head rows
    (``layers.attend``), and fold where that is at least ``margin`` faster. Some CPU kernels
    run a one-row grouped query several times slower in bf16 than the folded one, and in fp32
    the grouped path copies each request's keys and values out to every query head, which a
    forward pays for from memory. A GPU keeps its own kernels; without grouped heads there is
    nothing to fold."""
    c = target.config
    if target.device.type != "cpu" or c.num_heads == c.num_kv_heads:
        return target
    dev = target.device
    parts = [Part(target.new_arena(1, context + 1), i, torch.tensor([context], device=dev),
                  torch.ones(1, context + 1, dtype=torch.bool, device=dev)) for i in range(requests)]
    tokens = torch.zeros(requests, dtype=torch.long, device=dev)
    positions = torch.full((requests,), context, device=dev)

    def fold(on: bool) -> None:
        for module in target.modules():
            if isinstance(module, Attention):
                module.fold_groups = on
        target.fold_groups = on

    def step(on: bool) -> None:
        fold(on)
        target.packed(tokens, positions, parts)

    plain, folded = alternating_ms([lambda: step(False), lambda: step(True)], dev, repeats)
    fold(folded <= margin * plain)
    return target
