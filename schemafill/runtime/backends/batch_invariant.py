"""The batch-invariant backend: a row's logits, features and KV are the same bits whatever
else its call holds (how many rows, which slots around its own are masked), so a tree
verification row equals the one-row AR step at its position, and speculative decoders commit
AR's tokens by construction, in bf16 as in fp32 (docs/design.md, "Batch-invariant forwards").

Every product is row-invariant — the kernels' own product over a blocked copy of each weight
where the build has it for the target's dtype (bf16: 512-bit vectors; fp32: AVX2), else
oneDNN's padded packed product — and attention, with rotary and the KV writes, runs on the
kernels' attention, whose every sum runs along one vector lane in slot order
(``runtime/kernels/batch_invariant.c``). Each residual add runs with the norm after it in one
call, and where the build has the product and the target has no Q/K norms each decoder layer
is one call (``layer_bf16``, ``layer_f32``: the same kernels in the same order, without the
per-layer Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from schemafill.runtime import host, host_cache, products
from schemafill.runtime import probing
from schemafill.runtime.calls import Backend, Forward, Part, Product
from schemafill.runtime.kernels import batch_invariant as kernels
from schemafill.runtime.layers import plain, signed_sin
from schemafill.runtime.model import Target
from schemafill.runtime.storage import KVArena


# an fp32 target takes batch-invariant forwards where the decode loop's calls take at most this
# share of the other backend's time: lossless by construction is worth a few percent
MARGIN = 1.05
PROBE_ROWS = (1, 8)  # an AR step and a verification, timed together


def possible(dtype: torch.dtype) -> bool:
    """Whether this host can run batch-invariant ``dtype`` forwards: the kernels (a C compiler),
    with their own ``dtype`` products (bf16: 512-bit vectors; fp32: AVX2) or oneDNN's packed ones."""
    if not kernels.available():
        return False
    return kernels.products_available(dtype) or products.packs(dtype)


class Blocked:
    """The kernels' own product over a blocked copy of every weight, as the model's ``product``."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weights = {m: kernels.pack(m.weight, m.bias) for m in linears}

    def __call__(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # [..., In] -> [..., Out]
        rows = x.numel() // x.shape[-1]
        return kernels.product(x.reshape(rows, -1), self.weights[linear]).view(*x.shape[:-1], -1)

    def describe(self) -> str:
        return f"{products.PROBE_ROWS[-1]}:blocked"


@dataclass(frozen=True)
class KernelRows:
    """A batch-rows call's attention on the kernels: batch row b writes to arena row ``rows[b]``;
    each row reads just the slots it sees (``visible`` [B, T, S] boolean)."""

    arena: KVArena
    rows: torch.Tensor | None  # [B] (None: rows 0..B-1)
    slots: torch.Tensor  # [B, T]
    visible: torch.Tensor

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        rows = range(q.shape[0]) if self.rows is None else self.rows.tolist()
        return kernels.rope_attend(q, k, v, cos, sin, self.slots, [self.arena.k[layer][r] for r in rows],
                                   [self.arena.v[layer][r] for r in rows], self.visible)

    def groups(self, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
        """The call as ``layer_group`` arguments: one group of every batch row."""
        rows = range(self.slots.shape[0]) if self.rows is None else self.rows.tolist()
        return [layer_group(self.arena, list(rows), 0, self.slots, self.visible, cos, sin)]


@dataclass(frozen=True)
class KernelParts:
    """A packed call's attention on the kernels: each part over its own arena."""

    parts: list[Part]
    visibles: list[torch.Tensor]  # [1, T, S] boolean per part

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        outs = []
        for part, visible in zip(self.parts, self.visibles):
            a, b = part.start, part.stop
            outs.append(kernels.rope_attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cos[:, :, a:b], sin[:, :, a:b],
                                            part.slots[None], [part.arena.k[layer][0]], [part.arena.v[layer][0]],
                                            visible))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def groups(self, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
        """The call as ``layer_group`` arguments: one group a part."""
        return [layer_group(p.arena, [0], p.start, p.slots[None], visible, cos[:, :, p.start:p.stop],
                            sin[:, :, p.start:p.stop]) for p, visible in zip(self.parts, self.visibles)]


def layer_group(arena: KVArena, rows: list[int], row0: int, slots: torch.Tensor, visible: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """One attention call of ``kernels.LayerCall`` — batch rows ``rows`` of ``arena``, whose
    tokens are the call's rows from ``row0`` on; slots [B, T]; visible [B, T, S] boolean; cos,
    sin: [B, 1, T, hd] — with the tensors it points into (to keep alive through the layers)."""
    visible, slots = kernels.checked(arena.capacity, visible, slots)
    k0 = arena.k[0]
    kv = arena.addresses()[:, :, rows].contiguous()
    b, t = slots.shape
    group = kernels.AttentionGroup(b, t, visible.shape[-1], row0, slots.data_ptr(), slots.stride(0), kv.data_ptr(),
                                   k0.stride(1), k0.stride(2), visible.data_ptr(), visible.stride(0),
                                   visible.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.stride(2))
    return group, (visible, slots, kv, cos, sin)


class BatchInvariant:
    """The batch-invariant forward of one target (module docstring)."""

    name = "batch_invariant"

    def __init__(self, target: Target, product: Blocked | products.Products, why: str = "") -> None:
        self.target, self.product, self.why = target, product, why
        # per layer, what the one-call layer takes, where it applies (the kernels have no Q/K norms)
        self.layer_calls: list[tuple] | None = None
        if isinstance(product, Blocked) and not target.config.qk_norm:
            layers = target.model.layers
            after = [layer.input_layernorm for layer in layers[1:]] + [target.model.norm]
            w = product.weights
            self.layer_calls = [(w[layer.self_attn.qkv].args, w[layer.self_attn.o_proj].args,
                                 w[layer.mlp.gate_up].args, w[layer.mlp.down_proj].args,
                                 layer.post_attention_layernorm.weight.data_ptr(), norm.weight.data_ptr())
                                for layer, norm in zip(layers, after)]

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        return self.target.own_arena(rows, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        # each row reads just the slots it sees: ``spans`` would change nothing
        return self._run(tokens, positions, KernelRows(arena, rows, write_slots, visibility), logits_at)

    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        return self._run(tokens[None], positions[None], KernelParts(parts, [p.visibility[None] for p in parts]),
                         None if logits_at is None else logits_at[None])

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: KernelRows | KernelParts,
             logits_at: torch.Tensor | None) -> Forward:
        target, c = self.target, self.target.config
        x = target.model.embed_tokens(tokens)  # [B, T, H]
        cos, sin = target.rotary(positions, x.dtype)
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [B, 1, T, hd]
        saved: dict[int, torch.Tensor] = {}
        if self.layer_calls is not None:
            h = self._one_call_a_layer(x, cos, sin, attend, saved)
        else:
            h = self._layer_by_layer(x, cos, sin, attend, saved)
        final = h if logits_at is None else h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))
        logits = self.product(target.lm_head, final)
        aux = torch.cat([saved[i] for i in c.aux_layer_ids], dim=-1)
        return Forward(logits=logits.float(), aux=aux, final=final)

    def _layer_by_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        attend: KernelRows | KernelParts, saved: dict) -> torch.Tensor:
        """The layers one op at a time, each residual add with the norm after it in one call.
        Returns the final norm [B, T, H]."""
        c, layers, product = self.target.config, self.target.model.layers, self.product
        x, h = kernels.add_rms_norm(x, None, layers[0].input_layernorm.weight, c.rms_norm_eps)
        for i, layer in enumerate(layers):
            if i in c.aux_layer_ids:
                saved[i] = x
            x, h = kernels.add_rms_norm(x, layer.self_attn(h, cos, sin, i, attend, product),
                                        layer.post_attention_layernorm.weight, c.rms_norm_eps)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.target.model.norm
            x, h = kernels.add_rms_norm(x, mlp(layer.mlp, h, product), after.weight, c.rms_norm_eps)
        return h

    def _one_call_a_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          attend: KernelRows | KernelParts, saved: dict) -> torch.Tensor:
        """Each layer one kernels call (``layer_bf16``, ``layer_f32``: the same kernels in the same
        order as ``_layer_by_layer``), so the per-layer Python a small call pays for is gone.
        Returns the final norm [B, T, H]."""
        c = self.target.config
        layers = self.target.model.layers
        x, h = kernels.add_rms_norm(x, None, layers[0].input_layernorm.weight, c.rms_norm_eps)
        b, t, width = x.shape
        rows, hd, qw = b * t, c.head_dim, c.num_heads * c.head_dim
        inter = layers[0].mlp.down_proj.in_features
        groups, keep = zip(*attend.groups(cos.contiguous(), sin.contiguous()))
        sizes = [rows * (qw + 2 * c.num_kv_heads * hd), rows * qw, rows * qw, rows * width, rows * 2 * inter,
                 rows * inter]
        scratch = torch.empty(sum(sizes), dtype=x.dtype)
        at = [scratch.data_ptr() + scratch.element_size() * sum(sizes[:i]) for i in range(len(sizes))]
        table = (kernels.AttentionGroup * len(groups))(*groups)
        call = kernels.LayerCall(rows, width, c.num_heads, c.num_kv_heads, hd, inter, len(groups),
                                 c.rms_norm_eps, hd ** -0.5, table, *at)
        run, xp, hp = kernels.by_dtype("layer", x.dtype), x.data_ptr(), h.data_ptr()
        for i, args in enumerate(self.layer_calls):
            if i in c.aux_layer_ids:
                saved[i] = x.clone()
            run(call, i, *args, xp, hp)
        del keep  # what the groups point into lived until here
        return h

    def draft_steps(self, head: nn.Module) -> None:
        return None  # a head drafts eagerly beside it

    def head_product(self, head: nn.Module) -> Product:
        """The kernels' own product over a blocked copy of the head's weights where they have one
        for its dtype, else ``nn.Linear``'s. A head's numbers only shape the proposals (every
        committed token is the target's), so here the product is chosen for speed alone: the
        BLAS's few-row products stream the head's weights at a fraction of the read rate."""
        linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
        dtype = linears[0].weight.dtype
        if not kernels.products_available(dtype) or dtype == torch.bfloat16 and any(m.in_features % 2 for m in linears):
            return plain
        return Blocked(linears)

    def key(self) -> str:
        return f"{self.product.describe()}|batch_invariant:{kernels.build_id()}"

    def summary(self) -> dict:
        return {"backend": self.name, "why": self.why, "products": self.product.describe(),
                "one_call_a_layer": self.layer_calls is not None, "kernels": kernels.build_id()}


def mlp(block: nn.Module, x: torch.Tensor, product: Product) -> torch.Tensor:  # [B, T, H]
    """The MLP of a layer (gate/up fused), silu·up on the kernels as the one-call layer runs it."""
    b, t, _ = x.shape
    act = kernels.silu_mul(product(block.gate_up, x).view(b * t, -1))
    return product(block.down_proj, act).view(b, t, -1)


def build(target: Target, why: str = "") -> BatchInvariant | None:
    """The batch-invariant backend of a CPU target, or None where there is no room for the copy of
    its weights the products need (it then keeps batch-variant forwards: said once). Q/K/V and
    gate/up are fused first: the layers call those products directly."""
    if not possible(target.dtype):
        raise RuntimeError(f"no batch-invariant {target.dtype} forward on this host (it needs a C compiler, and "
                           f"the kernels' own {target.dtype} product or oneDNN packing of {target.dtype} weights)")
    linears = target.fuse().linears
    if not products.room_to_pack(products.weight_bytes(linears), host.available_memory()):
        print("[runtime] no room for packed weights: forwards stay batch-variant (verify in fp32)")
        return None
    blocked = kernels.products_available(target.dtype) and (
        target.dtype != torch.bfloat16 or all(m.in_features % 2 == 0 for m in linears))
    return BatchInvariant(target, Blocked(linears) if blocked else products.packed_everywhere(linears), why)


@torch.inference_mode()
def choose(target: Target, other: Callable[[str], Backend], cache_dir=None) -> Backend:
    """For an fp32 CPU target whose kernels have their own fp32 product: the batch-invariant
    backend where a timed probe of the decode loop's calls (``PROBE_ROWS`` after
    ``probing.CONTEXT`` positions) finds it within ``MARGIN`` of the backend ``auto`` would take
    otherwise (``other(why)`` builds it, told why), else that one. The timings are cached per
    host, target shape and kernels' build, so a later launch that finds batch-invariant chosen
    builds nothing else; the choice and why are the backend's ``summary``."""
    invariant = build(target)
    if invariant is None:
        return other("auto: no room for the batch-invariant backend's packed weights")
    c = target.config
    key = "|".join([f"{c.family}-L{c.num_layers}-H{c.hidden_size}-I{c.intermediate_size}-V{c.vocab_size}",
                    str(target.dtype), invariant.key(), f"rows{PROBE_ROWS}", *host.timing_key()])
    path = host_cache.entry(cache_dir or host_cache.folder("backends"), key)
    fallback = None
    with host_cache.measuring(path):  # another launch probing now: wait, then read what it measured
        saved = host_cache.read(path, key)
        cached = saved is not None and {"invariant_ms", "other_ms", "other"} <= set(saved)
        if not cached:
            fallback = other("auto: timed against the batch-invariant backend")
            start = time.perf_counter()
            invariant_ms, other_ms = probing.decode_ms(target, [invariant, fallback], PROBE_ROWS)
            saved = {"invariant_ms": round(invariant_ms, 3), "other_ms": round(other_ms, 3),
                     "other": fallback.name, "probe_s": round(time.perf_counter() - start, 1)}
            host_cache.write(path, key, saved, "the batch-invariant probe")
    calls = " + ".join(f"c({r})" for r in PROBE_ROWS)
    measured = (f"timed probe{' (cached)' if cached else ''}: {calls} batch-invariant {saved['invariant_ms']:.1f} ms, "
                f"{saved['other']} {saved['other_ms']:.1f} ms")
    if saved["invariant_ms"] <= MARGIN * saved["other_ms"]:
        invariant.why = f"auto: {measured}: batch-invariant"
        return invariant
    fallback = fallback or other("auto: not batch-invariant")
    fallback.why = f"auto: {measured}: {saved['other']}; {fallback.why}"
    return fallback
