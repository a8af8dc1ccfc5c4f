"""The compiled backend: the model's layers through ``torch.compile`` (inductor), attention over
the KV arena eager between them.

What an eager forward spends beside its matrix products and attention is the small ops around
them — norms, rotary, SiLU·mul, residual adds — each a kernel launch and microseconds of Python.
Here the work between two attentions is one compiled function (``between``): a layer's output
projection, residual add, norm, MLP and residual add, then the next layer's norm, Q/K/V product,
Q/K norms and rotary. Its weights are arguments, so one compiled graph serves every layer:
compiling costs a layer's worth, not the model's. Attention — the KV writes, the masks, a packed call's
parts, the CPU's query blocks — stays eager (``eager.RowsAttention.rotated``), so every call shape
the eager backend takes runs here too.

Which calls: the decode loop's smallest, where a call's fixed overhead weighs most — the rows of
the eager product plan's first range (one row, and few-row verifications), on that range's
kernel, as long as it needs no packed weights (oneDNN's packed copies cannot be graph inputs),
and beyond it as far as whole calls of more rows measure faster compiled (``EXTENTS``): a
product plan is timed on products alone, and a verification of a few more rows than its first
range can still be mostly the small ops around them. Bigger calls run on the eager backend. So a handful of small
graphs serve every layer and every covered call (one row, and a few rows traced as a symbol), all
compiled when the backend is built: no call compiles mid-decode.

On a CPU target without a batch-invariant forward (fp32 without a C compiler, or where the
batch-invariant probe finds it slower) ``auto`` takes it where
a timed probe of one-row steps after 512 positions finds it faster than eager (``choose``,
cached per host and shape).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from schemafill.runtime import host, host_cache, products
from schemafill.runtime import probing
from schemafill.runtime.backends.eager import Eager, PartsAttention, RowsAttention
from schemafill.runtime.calls import Forward, Part, Product
from schemafill.runtime.layers import apply_rotary_rolled, plain, rms_norm, signed_sin
from schemafill.runtime.model import DecoderLayer, Target, split_heads
from schemafill.runtime.storage import KVArena

MARGIN = 0.95  # compiled is chosen where its calls take at most this share of eager's time
EXTENTS = (8, 16, 32)  # row counts a compiled call may reach past the first range, probed in turn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    # x: [B, T, In] -> [B, T, Out]
    rows = x.shape[0] * x.shape[1]
    return products.on_weights(x.reshape(rows, -1), weight, bias, kernel).view(x.shape[0], x.shape[1], -1)


def attention_in(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor,
                 qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 kernel: str, heads: tuple[int, int, int], eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's norm, Q/K/V product, Q/K norms and rotary: rotated q [B, Hq, T, hd], k and v [B, Hkv, T, hd]."""
    b, t, _ = x.shape
    q, k, v = split_heads(linear(rms_norm(x, norm, eps), qkv, qkv_bias, kernel), b, t, heads, q_norm, k_norm, eps)
    return apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin), v


def attention_out(x: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, o_bias: torch.Tensor | None,
                  norm: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
                  down_bias: torch.Tensor | None, kernel: str, eps: float) -> torch.Tensor:
    """The rest of a layer after its attention ([B, Hq, T, hd]): output projection, residual, MLP, residual."""
    b, _, t, _ = attn.shape
    x = x + linear(attn.transpose(1, 2).reshape(b, t, -1), o, o_bias, kernel)
    gate, up = linear(rms_norm(x, norm, eps), gate_up, gate_up_bias, kernel).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down, down_bias, kernel)


def between(x: torch.Tensor, attn: torch.Tensor, out_weights: tuple, in_weights: tuple, cos: torch.Tensor,
            sin: torch.Tensor, kernel: str, heads: tuple[int, int, int], eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's ``attention_out`` and the next one's ``attention_in``: the residual stream and rotated q, k, v."""
    x = attention_out(x, attn, *out_weights, kernel, eps)
    return (x, *attention_in(x, cos, sin, *in_weights, kernel, heads, eps))


def leave(x: torch.Tensor, attn: torch.Tensor, out_weights: tuple, norm: torch.Tensor, head: torch.Tensor,
          logits_at: torch.Tensor, kernel: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's ``attention_out``, the final norm and the LM head (at ``logits_at`` [B, K])."""
    x = attention_out(x, attn, *out_weights, kernel, eps)
    x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
    final = rms_norm(x, norm, eps)
    return final, linear(final, head, None, kernel)


def in_weights(layer: DecoderLayer) -> tuple:
    a = layer.self_attn
    norms = (a.q_norm.weight, a.k_norm.weight) if a.c.qk_norm else (None, None)
    return (layer.input_layernorm.weight, a.qkv.weight, a.qkv.bias, *norms)


def out_weights(layer: DecoderLayer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return (a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight, m.gate_up.weight, m.gate_up.bias,
            m.down_proj.weight, m.down_proj.bias)


class Compiled:
    """The model's layers as compiled functions between eager attentions (module docstring)."""

    name = "compiled"

    def __init__(self, target: Target, eager: Eager, why: str = "", rows: int | None = None) -> None:
        self.target, self.eager, self.why = target.fuse(), eager, why
        c = target.config
        self.heads, self.eps = (c.num_heads, c.num_kv_heads, c.head_dim), c.rms_norm_eps
        # the calls it runs: the eager plan's first range, on its kernel (none where it is packed),
        # or up to ``rows`` on that kernel where a probe found whole calls of them faster here
        first = eager.products.plan[0] if eager.products is not None and eager.products.plan else (1, "plain")
        self.rows, self.kernel = (first[0], first[1]) if first[1] != "packed" else (0, "plain")
        if rows is not None and self.rows:
            self.rows = max(self.rows, rows)
        # a graph per row count first seen, then (a second count in the same kernel's range) rows
        # traced as a symbol: a handful of small graphs, whatever rows the loop sends
        self._in = torch.compile(attention_in)
        self._between = torch.compile(between)
        self._leave = torch.compile(leave)
        self.compile_s = 0.0

    @torch.inference_mode()
    def warm(self) -> "Compiled":
        """Compile now what the decode loop's calls need — one row, and a few rows traced as a
        symbol — so that no call compiles mid-decode."""
        sizes = [r for r in (1, 2, 3) if self.covers(r)]  # 1 and 2 rows give a graph each, 3 makes rows a symbol
        if not sizes:
            return self
        start = time.perf_counter()
        arena = self.new_arena(1, 2 * max(sizes))
        for rows in sizes:
            tokens, positions = torch.zeros(1, rows, dtype=torch.long), torch.arange(rows)[None]
            self.forward(tokens, positions, torch.ones(1, rows, rows, dtype=torch.bool).tril(), positions, arena)
        self.compile_s = round(time.perf_counter() - start, 1)
        return self

    def covers(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows runs compiled."""
        return rows <= self.rows

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        return self.eager.new_arena(rows, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        if not self.covers(tokens.numel()):
            return self.eager.forward(tokens, positions, visibility, write_slots, arena, rows, logits_at, spans)
        return self._run(tokens, positions, self.eager.rows_attention(visibility, write_slots, arena, rows, spans),
                         logits_at)

    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        if not self.covers(tokens.numel()):
            return self.eager.packed(tokens, positions, parts, logits_at)
        return self._run(tokens[None], positions[None], self.eager.parts_attention(parts),
                         None if logits_at is None else logits_at[None])

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: RowsAttention | PartsAttention,
             logits_at: torch.Tensor | None) -> Forward:
        # tokens, positions: [B, T]; logits_at: [B, K]
        target, c = self.target, self.target.config
        layers, kernel, heads, eps = target.model.layers, self.kernel, self.heads, self.eps
        x = target.model.embed_tokens(tokens)  # [B, T, H]
        cos, sin = target.rotary(positions, x.dtype)
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [B, 1, T, hd]
        saved = {0: x} if 0 in c.aux_layer_ids else {}
        q, k, v = self._in(x, cos, sin, *in_weights(layers[0]), kernel, heads, eps)
        for i, layer in enumerate(layers[:-1]):
            x, q, k, v = self._between(x, attend.rotated(i, q, k, v), out_weights(layer), in_weights(layers[i + 1]),
                                       cos, sin, kernel, heads, eps)
            if i + 1 in c.aux_layer_ids:
                saved[i + 1] = x
        if logits_at is None:  # every row's: one graph whether or not a call names its rows
            logits_at = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        final, logits = self._leave(x, attend.rotated(len(layers) - 1, q, k, v), out_weights(layers[-1]),
                                    target.model.norm.weight, target.lm_head.weight, logits_at, kernel, eps)
        aux = torch.cat([saved[i] for i in c.aux_layer_ids], dim=-1)
        return Forward(logits=logits.float(), aux=aux, final=final)

    def draft_steps(self, head: nn.Module) -> None:
        return None  # a head drafts eagerly beside it

    def head_product(self, head: nn.Module) -> Product:
        return plain  # the head drafts eagerly beside it, on nn.Linear's own products

    def key(self) -> str:
        return f"{self.eager.key()}|compiled:{self.rows}:{self.kernel}"

    def summary(self) -> dict:
        return {"backend": self.name, "why": self.why, "products": self.eager.summary()["products"],
                "compiled_rows": self.rows, "compiled_kernel": self.kernel, "fold_groups": self.eager.fold,
                "compile_s": self.compile_s}


def build(target: Target, eager: Eager, why: str = "") -> Compiled:
    """The compiled backend over ``eager`` (its tuned products and attention)."""
    if target.device.type != "cpu":
        raise ValueError("the compiled backend runs a CPU target (a GPU replays CUDA graphs: model.backend=cuda_graphs)")
    return Compiled(target, eager, why).warm()


def choose(target: Target, eager: Eager, cache_dir=None) -> Eager | Compiled:
    """Compiled where a timed probe of one-row steps beats eager by ``MARGIN``, else eager. The
    timings are cached per host, target shape, dtype and eager plan (the first time compiles
    too); the choice and why are the backend's ``summary``."""
    c = target.config
    compiled = Compiled(target, eager)
    rows = (1,)
    if not compiled.covers(1):
        eager.why = "auto: one-row products on oneDNN's packed weights, which no compiled graph holds"
        return eager
    key = "|".join([f"{c.family}-L{c.num_layers}-H{c.hidden_size}-I{c.intermediate_size}-V{c.vocab_size}",
                    str(target.dtype), compiled.key(), f"rows{rows}", *host.timing_key()])
    path = host_cache.entry(cache_dir or host_cache.folder("backends"), key)
    saved = host_cache.read(path, key)
    cached = saved is not None and {"eager_ms", "compiled_ms"} <= set(saved)
    if not cached:
        start = time.perf_counter()
        probing.decode_ms(target, [eager, compiled], rows, repeats=1)  # compiles, and the host settles after the load
        eager_ms, compiled_ms = probing.decode_ms(target, [eager, compiled], rows, repeats=15)
        saved = {"eager_ms": round(eager_ms, 3), "compiled_ms": round(compiled_ms, 3),
                 "probe_s": round(time.perf_counter() - start, 1)}
        host_cache.write(path, key, saved, "the backend probe")
    calls = " + ".join(f"c({r})" for r in rows)
    measured = (f"timed probe{' (cached)' if cached else ''}: {calls} eager {saved['eager_ms']:.1f} ms, "
                f"compiled {saved['compiled_ms']:.1f} ms")
    if saved["compiled_ms"] > MARGIN * saved["eager_ms"]:
        eager.why = f"auto: {measured}: eager"
        return eager
    if "extents" not in saved:  # whole calls of more rows, until compiled stops winning
        saved["extents"] = {}
        for r in (r for r in EXTENTS if r > compiled.rows):
            # the probe's warm-up call compiles what is not yet (rows are a symbol in its graphs)
            times = probing.decode_ms(target, [eager, Compiled(target, eager, rows=r)], (r,), repeats=5)
            saved["extents"][str(r)] = [round(t, 3) for t in times]
            if times[1] > MARGIN * times[0]:
                break
        host_cache.write(path, key, saved, "the backend probe")
    covered = widest(compiled.rows, saved["extents"])
    wider = "".join(f", c({r}) {e:.1f} / {c:.1f} ms" for r, (e, c) in saved["extents"].items())
    reach = f"{covered} row{'s' if covered > 1 else ''}"
    compiled = Compiled(target, eager, f"auto: {measured}: compiled, to {reach} (eager / compiled{wider})", covered)
    return compiled.warm()


def widest(first: int, extents: dict[str, list[float]]) -> int:
    """The most rows a compiled call covers: ``first`` (the product plan's first range), then
    each probed row count (``{"8": [eager_ms, compiled_ms]}``) while compiled takes at most
    ``MARGIN`` of eager's time, the counts in order."""
    rows = first
    for r, (eager_ms, compiled_ms) in sorted(extents.items(), key=lambda item: int(item[0])):
        if compiled_ms > MARGIN * eager_ms:
            break
        rows = max(rows, int(r))
    return rows
