"""The eager backend: the model's layers op by op in torch, attention on SDPA over the KV arena.
It runs anywhere (CPU and CUDA) and takes any call; the other backends fall back to it for the
calls they do not cover.

On a CPU it is tuned at load, each choice by a timed probe cached per host and shape:

* **products**: per row count the fastest of three kernels (``runtime/products.py``);
* **folded attention**: one-token queries sharing a KV head attend as that head's rows
  (``layers.attend``) where it is faster (``tune_attention``);
* **query blocks**: a call's rows attend in blocks, each over only the slots its rows reach
  (``layers.query_blocks``): a prompt's causal rows and SIDE rows far past MAIN's skip most
  of the masked-out work. A GPU attends in one call, where a launch costs more than the
  masked work it would save and reading the mask back would stall the launch queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from schemafill.runtime import products
from schemafill.runtime.calls import Forward, Part, Product
from schemafill.runtime.layers import apply_rotary_rolled, attend, mask_bias, plain, query_blocks
from schemafill.runtime.model import Target
from schemafill.runtime.storage import KVArena
from schemafill.runtime.timing import alternating_ms

# what one more attention call costs on a CPU, in FLOPs of attention work (4 per head dim per
# (row, slot) pair): a call's fixed overhead is worth a few hundred thousand (row, slot) pairs
# of a small model's heads, so blocks are split only where they save more than that
CPU_CALL_FLOPS = 2e6


@dataclass(frozen=True)
class RowsAttention:
    """A batch-rows call's attention: batch row b writes to arena row ``rows[b]`` and attends
    under its additive mask, in query blocks (``blocks``) or row by row over its own slots
    (``spans``: one ``(arena row, slots)`` per batch row)."""

    arena: KVArena
    rows: torch.Tensor | None  # [B] (None: rows 0..B-1)
    slots: torch.Tensor  # [B, T]
    bias: torch.Tensor  # [B, T, S] additive (``layers.mask_bias``)
    spans: list[tuple[int, int]] | None
    blocks: list[tuple[int, int, int]] | None
    fold: bool

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        # q: [B, Hq, T, hd]; k, v: [B, Hkv, T, hd]; cos, sin: [B, 1, T, hd]
        return self.rotated(layer, apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin), v)

    def rotated(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of queries and keys already rotated."""
        arena, bias = self.arena, self.bias
        arena.write(layer, self.rows, self.slots, k, v)
        if self.spans is None:
            keys, values = arena.read(layer, self.rows, bias.shape[-1])  # [B, Hkv, S, hd]
            return attend(q, keys, values, bias, self.blocks, self.fold)
        # ragged: each row reads only its own slots, straight from the arena
        return torch.cat([attend(q[b:b + 1], arena.k[layer][r:r + 1, :, :n], arena.v[layer][r:r + 1, :, :n],
                                 bias[b:b + 1, :, :n], fold_groups=self.fold) for b, (r, n) in enumerate(self.spans)])


@dataclass(frozen=True)
class PartsAttention:
    """A packed call's attention: a batch of one whose rows are the parts' rows one after
    another, each part over its own arena (in query blocks on a CPU)."""

    parts: list[Part]
    blocks: list[list[tuple[int, int, int]] | None]
    biases: list[torch.Tensor]  # [1, T, S] per part, additive
    fold: bool

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return self.rotated(layer, apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin), v)

    def rotated(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of queries and keys already rotated."""
        outs = []
        for part, blocks, bias in zip(self.parts, self.blocks, self.biases):
            a, b = part.start, part.stop
            part.arena.write(layer, None, part.slots[None], k[:, :, a:b], v[:, :, a:b])
            keys, values = part.arena.read(layer, None, bias.shape[-1])  # [1, Hkv, S, hd]
            outs.append(attend(q[:, :, a:b], keys, values, bias, blocks, self.fold))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def reach(visibility: torch.Tensor) -> list[int]:
    """[B, T, S] -> per row t, one past the last slot any batch row's token t may see."""
    seen = visibility.any(0)  # [T, S]
    return (seen.shape[-1] - seen.flip(-1).to(torch.uint8).argmax(-1)).tolist()


class Eager:
    """The model's layers op by op (module docstring). ``products``: the CPU product plan (None:
    ``nn.Linear``'s own); ``fold``: one-token attention folded into KV-head rows."""

    name = "eager"

    def __init__(self, target: Target, products: products.Products | None = None, fold: bool = False,
                 why: str = "") -> None:
        self.target, self.products, self.fold, self.why = target, products, fold, why
        c = target.config
        # one more attention call's cost on a CPU in (row, slot) pairs of attention work
        self.block_overhead = int(CPU_CALL_FLOPS / (4 * c.num_heads * c.head_dim))

    @property
    def product(self) -> Product:
        return self.products if self.products is not None else plain

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        return self.target.own_arena(rows, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        return self.target.run(tokens, positions, self.rows_attention(visibility, write_slots, arena, rows, spans),
                               logits_at, self.product)

    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        return self.target.run(tokens[None], positions[None], self.parts_attention(parts),
                               None if logits_at is None else logits_at[None], self.product)

    def rows_attention(self, visibility: torch.Tensor, write_slots: torch.Tensor, arena: KVArena,
                       rows: torch.Tensor | None, spans: list[tuple[int, int]] | None) -> RowsAttention:
        """A batch-rows call's attention (``Target.forward``'s arguments)."""
        blocks = query_blocks(reach(visibility), self.block_overhead) \
            if spans is None and visibility.device.type == "cpu" else None
        bias = mask_bias(visibility, self.target.dtype)  # once, not in every layer's attention
        return RowsAttention(arena, rows, write_slots, bias, spans, blocks, self.fold)

    def parts_attention(self, parts: list[Part]) -> PartsAttention:
        """A packed call's attention, each part over its own arena."""
        cpu = parts[0].slots.device.type == "cpu"
        blocks = [query_blocks(reach(p.visibility[None]), self.block_overhead) if cpu else None for p in parts]
        biases = [mask_bias(p.visibility[None], self.target.dtype) for p in parts]
        return PartsAttention(parts, blocks, biases, self.fold)

    def draft_steps(self, head: nn.Module) -> None:
        return None  # a head drafts eagerly beside it

    def head_product(self, head: nn.Module) -> Product:
        return plain  # the head drafts as it always has, on nn.Linear's own products

    def key(self) -> str:
        plan = "" if self.products is None else self.products.describe()
        return f"{plan}|fold{int(self.fold)}"

    def summary(self) -> dict:
        return {"backend": self.name, "why": self.why,
                "products": None if self.products is None else self.products.describe(), "fold_groups": self.fold}


def build(target: Target, cache_dir=None, why: str = "") -> Eager:
    """The eager backend of a freshly loaded target: on a CPU with Q/K/V and gate/up fused and
    its products and attention tuned by timed probes (a few seconds, cached per host and shape);
    a GPU keeps its own kernels."""
    if target.device.type != "cpu":
        return Eager(target, why=why)
    target.fuse()
    backend = Eager(target, products.tuned(target.linears, cache_dir), why=why)
    backend.fold = tune_attention(backend)
    return backend


@torch.inference_mode()
def tune_attention(backend: Eager, margin: float = 0.9, repeats: int = 5, context: int = 512,
                   requests: int = 8) -> bool:
    """Whether one-token attention should fold grouped heads into KV-head rows: one decoding step
    of ``requests`` one-token requests, each over its own arena of ``context`` slots (a batched
    round's attention calls, one per request and layer, between the weights the forward
    streams), timed with SDPA's grouped-head path and folded, folded where that is at least
    ``margin`` faster. Some CPU kernels run a one-row grouped query several times slower in bf16
    than the folded one, and in fp32 the grouped path copies each request's keys and values out
    to every query head, which a forward pays for from memory. Without grouped heads there is
    nothing to fold."""
    target = backend.target
    c = target.config
    if target.device.type != "cpu" or c.num_heads == c.num_kv_heads:
        return False
    dev = target.device
    parts = [Part(backend.new_arena(1, context + 1), i, torch.tensor([context], device=dev),
                  torch.ones(1, context + 1, dtype=torch.bool, device=dev)) for i in range(requests)]
    tokens = torch.zeros(requests, dtype=torch.long, device=dev)
    positions = torch.full((requests,), context, device=dev)

    def step(on: bool) -> None:
        backend.fold = on
        backend.packed(tokens, positions, parts)

    plain_ms, folded_ms = alternating_ms([lambda: step(False), lambda: step(True)], dev, repeats)
    return folded_ms <= margin * plain_ms
