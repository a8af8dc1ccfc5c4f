"""The target model: a Llama-family decoder (Llama and SmolLM2, Mistral, Qwen2 with q/k/v
biases, Qwen3 with q/k norms) — its configuration, layers, weights, rotary tables and the math
of one forward — and reading its weights from a Hugging Face checkpoint.

What executes a call is not decided here: a target runs its calls on the backend it was given
at load (``runtime.backends.attach``), which passes the model its attention over the KV arena
(``Attend``) and its products (``Product``) where it runs the layers through ``Target.run``, or
runs them on kernels of its own. Numerics follow ``transformers`` (norms and rotary tables in
fp32), so fp32 logits match it tightly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schemafill.runtime.calls import Attend, Backend, Forward, Part, Product
from schemafill.runtime.layers import MLP, RMSNorm, Rotary, fused_linear, plain, rms_norm, signed_sin
from schemafill.runtime.storage import ArenaStock, KVArena

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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
        if aux_layer_ids is None:  # the EAGLE-3 default (docs/design.md, "The runtime"): [2, L//2, L-3]
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


class Attention(nn.Module):
    def __init__(self, c: RuntimeConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv: nn.Linear | None = None

    def fuse(self) -> None:
        """Q, K and V as one product (``qkv``); the three projections are dropped."""
        self.qkv = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def heads(self, qkv: torch.Tensor, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``split_heads`` of the fused product, with this layer's Q/K norms."""
        c = self.c
        norms = (self.q_norm.weight, self.k_norm.weight) if c.qk_norm else (None, None)
        return split_heads(qkv, b, t, (c.num_heads, c.num_kv_heads, c.head_dim), *norms, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attend: Attend,
                product: Product = plain) -> torch.Tensor:
        # x: [B, T, H]; cos, sin: [B, 1, T, hd], sin with its first half negated (``layers.signed_sin``)
        b, t, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.heads(product(self.qkv, x), b, t)
        else:
            q, k, v = (product(p, x).view(b, t, -1, self.c.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            if self.c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
        out = attend(layer, q, k, v, cos, sin)  # [B, Hq, T, hd]
        return product(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))


def split_heads(qkv: torch.Tensor, b: int, t: int, heads: tuple[int, int, int], q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Q/K/V product's output [B, T, (Hq + 2·Hkv)·hd] as q [B, Hq, T, hd], k and v
    [B, Hkv, T, hd]; q and k normed over each head's dimensions where the family has Q/K norms."""
    hq, hkv, hd = heads
    q, k, v = qkv.view(b, t, -1, hd).transpose(1, 2).split([hq, hkv, hkv], dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return q, k, v


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


class Target(nn.Module):
    """The target model as the decoders see it: ``forward`` (batch rows) and ``packed`` calls
    returning a ``Forward``, and ``new_arena``, each run by its ``backend``."""

    def __init__(self, c: RuntimeConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 hf_config: Any = None) -> None:
        super().__init__()
        self.config = c
        self.hf_config = hf_config  # the transformers config it came from (heads are shaped from it)
        self.model = Backbone(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(inv_freq, attention_scaling)
        self.backend: Backend | None = None  # what runs its calls (``runtime.backends.attach``)
        self.arenas = ArenaStock()  # ended requests' arenas, for the next ones

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def linears(self) -> list[nn.Linear]:
        """Every projection and the LM head."""
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def runs_on(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("this target has no backend: load it with runtime.loading.load_target or "
                               "from_hf_model, or attach one (runtime.backends.attach)")
        return self.backend

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        """An arena its backend's calls can read."""
        return self.runs_on().new_arena(rows, capacity)

    def own_arena(self, rows: int, capacity: int) -> KVArena:
        """A ``KVArena`` of its own shape, dtype and device (what a backend without storage of its
        own hands out); a one-row arena (a request's) may be an ended request's, zeroed, with
        room for up to twice ``capacity`` (``ArenaStock``)."""
        c = self.config
        if rows == 1:
            return self.arenas.take(c.num_layers, c.num_kv_heads, capacity, c.head_dim, self.dtype, self.device)
        return KVArena(c.num_layers, rows, c.num_kv_heads, capacity, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        """tokens, positions, write_slots: [B, T]; visibility: [B, T, S] over arena slots
        0..S-1 (every write slot must be < S, and a token must see its own slot);
        rows: [B] arena rows (default: rows 0..B-1); logits_at: [B, K] indices into T.

        ``spans`` — one ``(arena row, slots)`` per batch row, where no token of that row sees
        a slot at or past ``slots`` — lets a backend attend per row over just its own slots
        (batched decoding, where rows differ in length)."""
        return self.runs_on().forward(tokens, positions, visibility, write_slots, arena, rows, logits_at, spans)

    @torch.inference_mode()
    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        """Several requests' rows in one forward: tokens, positions: [N], the parts' rows one
        after another; logits_at: [K] indices into N. Every projection runs once over all N
        rows; each part attends over its own arena (``Part``). Returns a batch of one:
        logits [1, K, V], aux [1, N, 3·H], final [1, K, H]."""
        return self.runs_on().packed(tokens, positions, parts, logits_at)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
            logits_at: torch.Tensor | None = None, product: Product = plain) -> Forward:
        """The forward, layer by layer, with ``attend`` over the KV arena and ``product`` for
        every projection. tokens, positions: [B, T]; logits_at: [B, K]."""
        c = self.config
        x = self.model.embed_tokens(tokens)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [B, 1, T, hd], once for every layer
        saved = {}
        for i, layer in enumerate(self.model.layers):
            if i in c.aux_layer_ids:
                saved[i] = x
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, i, attend, product)
            x = x + layer.mlp(layer.post_attention_layernorm(x), product)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
        final = self.model.norm(x)
        logits = product(self.lm_head, final)
        aux = torch.cat([saved[i] for i in c.aux_layer_ids], dim=-1)
        return Forward(logits=logits.float(), aux=aux, final=final)

    def fuse(self) -> "Target":
        """Q/K/V and gate/up as one product each, in every layer (their weights are copied, so a
        target that will be trained is not fused)."""
        for layer in self.model.layers:
            if layer.self_attn.qkv is None:
                layer.self_attn.fuse()
            if layer.mlp.gate_up is None:
                layer.mlp.fuse()
        return self


def read_checkpoint(folder: str | Path, dtype: torch.dtype, device: torch.device,
                    aux_layer_ids: list[int] | None = None) -> Target:
    """The target in a local Hugging Face folder (config.json + safetensors), with no backend yet."""
    from transformers import AutoConfig

    folder = Path(folder)
    hf = AutoConfig.from_pretrained(folder)
    tables = rope_tables(hf)
    with torch.device("meta"):  # every parameter is then assigned from the checkpoint: no random init
        target = Target(RuntimeConfig.from_hf(hf, aux_layer_ids), *tables, hf_config=hf)
    state = {k: v.to(dtype) for k, v in _checkpoint_state(folder).items()}
    return _install(target, state).to(device).eval()


def sharing(model: Any, aux_layer_ids: list[int] | None = None) -> Target:
    """The target sharing the parameters of an in-memory ``transformers`` model, with no backend yet."""
    hf = model.config
    target = Target(RuntimeConfig.from_hf(hf, aux_layer_ids), *rope_tables(hf), hf_config=hf)
    return _install(target, dict(model.state_dict())).to(next(model.parameters()).device).eval()


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
