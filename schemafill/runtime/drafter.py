"""The EAGLE-3 draft head: what it is, its reduced vocabulary, and its on-disk format.

Architecture (EAGLE-3; vLLM/SGLang ``LlamaForCausalLMEagle3``): ``fc`` fuses three target
hidden states (3·H_target → H); one decoder layer ``midlayer`` whose attention reads
``[input_layernorm(token embedding); hidden_norm(hidden)]`` (2·H) with the hidden as the
residual; final ``norm``; ``lm_head`` over a reduced draft vocabulary. Token embeddings are
the target's, frozen and never exported. ``d2t[i]`` is the offset from draft id i to its
target id; ``t2d`` marks target ids that exist in the draft vocabulary.

Training-time test (``ttt_forward``): step 0 pairs token x[t+1] with the fused target
feature at t; step k pairs x[t+1+k] with the head's own step-(k-1) output at t, at
position t+k. A query at step k sees step-0 keys causally and, of steps 1..k, only its own
position (the diagonal) — exactly what it would see when drafting k tokens ahead.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from schemafill.runtime.calls import DraftSteps, Product
from schemafill.runtime.layers import MLP, RMSNorm, Rotary, apply_rotary, attend, plain
from schemafill.runtime.storage import KVArena

AUX_CONVENTION = "hf_hidden_states_index"  # id i = HF hidden_states[i] = the input of decoder layer i


def engine_layer_ids(aux_layer_ids: list[int] | tuple[int, ...]) -> dict[str, list[int]]:
    """The aux layer ids as each serving engine reads them, so both feed the trained layers.

    vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` first and captures the input
    of layer i (HF ``hidden_states[i]``), as we count. SGLang reads only
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures ``[i + 1 for i in ids]``
    (it means "the output of layer i"), so it must be written one lower.
    """
    ids = sorted(aux_layer_ids)  # both engines capture in ascending layer order
    if ids != list(aux_layer_ids):
        raise ValueError(f"aux_layer_ids must be ascending (the engines capture in layer order): {aux_layer_ids}")
    if ids and ids[0] < 1:
        raise ValueError(f"aux layer {ids[0]} cannot be written in SGLang's numbering (layer 0, the "
                         "embeddings, would be -1 there): use ids >= 1")
    return {"vllm": ids, "sglang": [i - 1 for i in ids]}


@dataclass
class HeadConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    aux_layer_ids: list[int] = field(default_factory=list)
    rope_scaling: dict | None = None
    num_hidden_layers: int = 1

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int]) -> "HeadConfig":
        """A head shaped like one decoder layer of the target."""
        t = target_config
        rope = getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        return cls(
            hidden_size=t.hidden_size, target_hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
            head_dim=head_dim, rms_norm_eps=t.rms_norm_eps, vocab_size=t.vocab_size,
            draft_vocab_size=min(draft_vocab_size, t.vocab_size),
            max_position_embeddings=t.max_position_embeddings, rope_theta=float(theta),
            aux_layer_ids=list(aux_layer_ids), rope_scaling=scaling,
        )


@dataclass
class DraftPart:
    """One request's rows in a drafting forward (``Eagle3Head.decode_packed``): ``input_ids``,
    ``positions``, ``write_slots`` [T]; ``hidden`` [T, H]; ``visibility`` [T, S] over the
    slots of its ``arena``; ``outputs``: the rows whose output hidden states are read (None:
    all), the others only write their keys and values."""

    arena: KVArena
    input_ids: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor
    write_slots: torch.Tensor
    outputs: list[int] | None = None


class Eagle3Layer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.c = c
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, c.num_attention_heads * c.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, h, bias=False)
        self.mlp = MLP(h, c.intermediate_size)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            rows: torch.Tensor | None = None, product: Product = plain):
        """Rotated q and k, and v, for new tokens. emb, hidden: [B, T, H]; ``rows`` [R]: the
        rows that query (None: all), every row's keys and values."""
        b, t, _ = emb.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        a = self.self_attn
        k = product(a.k_proj, x).view(b, t, -1, self.c.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = product(a.v_proj, x).view(b, t, -1, self.c.head_dim).transpose(1, 2)
        qx, qcos, qsin = (x, cos, sin) if rows is None else (x[:, rows], cos[:, rows], sin[:, rows])
        q = product(a.q_proj, qx).view(b, qx.shape[1], -1, self.c.head_dim).transpose(1, 2)  # [B, Hq, R, hd]
        return apply_rotary(q, qcos, qsin), apply_rotary(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor, product: Product = plain) -> torch.Tensor:
        """Output projection, residual on the hidden input, MLP. attn: [B, Hq, T, hd]."""
        b, _, t, _ = attn.shape
        h = hidden + product(self.self_attn.o_proj, attn.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.post_attention_layernorm(h), product)


class Eagle3Head(nn.Module):
    def __init__(self, c: HeadConfig, embed_tokens: nn.Embedding, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = embed_tokens
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = Rotary(inv_freq, attention_scaling)
        # the embeddings are the target's: never saved (checkpoints, exports), kept on load
        self.register_state_dict_post_hook(_drop_embeddings)
        self.register_load_state_dict_pre_hook(_keep_embeddings)
        # where its draft steps run when not eagerly, and what its projections run on when they
        # do: the target's backend says (CUDA graphs; the batch-invariant kernels' product)
        self.steps: DraftSteps | None = None
        self.product: Product = plain

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the draft vocabulary (target ids, in draft-id order)."""
        d2t, t2d = vocab_maps(draft_ids, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:  # [Vd] target id of each draft id
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def features(self, aux: torch.Tensor) -> torch.Tensor:  # [.., 3·Ht] -> [.., H]
        """The step-0 hidden input from the target's features at a committed position."""
        return self.product(self.fc, aux)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., Vd]
        return self.product(self.lm_head, self.norm(out))

    def new_arena(self, capacity: int) -> KVArena:
        """KV for one request's drafting (the head's single layer)."""
        if self.steps is not None:
            return self.steps.arena(capacity)
        c, w = self.config, self.fc.weight
        return KVArena(1, 1, c.num_key_value_heads, capacity, c.head_dim, w.dtype, w.device)

    @torch.inference_mode()
    def decode_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    visibility: torch.Tensor, write_slots: torch.Tensor, arena: KVArena,
                    outputs: list[int] | None = None) -> torch.Tensor:
        """One drafting forward over a KV arena; returns the output hidden states [B, T, H]
        ([B, R, H]: of the rows ``outputs`` only, when given).

        input_ids, positions, write_slots: [B, T]; hidden: [B, T, H] — ``fc(aux)`` for a
        committed position (training step 0), the parent's output for a draft node (step
        k > 0); visibility: [B, T, S] over arena slots, as in the runtime.
        """
        if self.steps is not None:
            out = self.steps.decode_step(input_ids, hidden, positions, visibility, write_slots, arena)
            if out is not None:
                return out if outputs is None else out[:, outputs]
        rows = None if outputs is None else torch.tensor(outputs, device=input_ids.device)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            arena.write(0, None, write_slots, k, v)
            keys, values = arena.read(0, None, visibility.shape[-1])
            return attend(q, keys, values, visibility if rows is None else visibility[:, rows])

        return self.attend_step(input_ids, hidden, positions, attention, rows)

    @torch.inference_mode()
    def decode_packed(self, parts: list["DraftPart"]) -> list[torch.Tensor]:
        """Several requests' drafting forwards as one: their rows go through ``fc``, the layer's
        projections and MLP together, each attends over its own arena. Returns each part's
        output hidden states [T_i, H] (of its ``outputs`` rows, when given). One part, or draft
        steps replayed by the target's backend (``steps``), runs as ``decode_step`` does."""
        if len(parts) == 1 or self.steps is not None:
            return [self.decode_step(p.input_ids[None], p.hidden[None], p.positions[None], p.visibility[None],
                                     p.write_slots[None], p.arena, p.outputs)[0] for p in parts]
        bounds, asked = [0], [0]  # each part's rows, and its rows among those that query
        for p in parts:
            bounds.append(bounds[-1] + len(p.input_ids))
            asked.append(asked[-1] + (len(p.input_ids) if p.outputs is None else len(p.outputs)))
        rows = None
        if any(p.outputs is not None for p in parts):
            rows = torch.tensor([lo + r for p, lo in zip(parts, bounds) for r in
                                 (range(len(p.input_ids)) if p.outputs is None else p.outputs)],
                                device=parts[0].input_ids.device)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, H*, ΣR, hd]
            outs = []
            for p, lo, hi, a, b in zip(parts, bounds, bounds[1:], asked, asked[1:]):
                p.arena.write(0, None, p.write_slots[None], k[:, :, lo:hi], v[:, :, lo:hi])
                keys, values = p.arena.read(0, None, p.visibility.shape[-1])
                visible = p.visibility if p.outputs is None else p.visibility[p.outputs]
                outs.append(attend(q[:, :, a:b], keys, values, visible[None]))
            return torch.cat(outs, dim=2)

        out = self.attend_step(torch.cat([p.input_ids for p in parts])[None], torch.cat([p.hidden for p in parts])[None],
                               torch.cat([p.positions for p in parts])[None], attention, rows)[0]  # [ΣR, H]
        return [out[a:b] for a, b in zip(asked, asked[1:])]

    def attend_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        """``decode_step`` with its KV handled by ``attention(q, k, v)`` (rotated q [B, Hq, R, hd],
        k, v [B, Hkv, T, hd]), which writes the new keys and values where it keeps them and attends.
        ``rows`` [R]: the rows whose outputs are computed (None: all). The others write keys and
        values only: a committed position's output is read by nobody (the next position's input
        is the target's features), so a catch-up over a prompt costs its rows' K and V alone."""
        dtype = hidden.dtype
        cos, sin = self.rotary(positions, dtype)
        q, k, v = self.midlayer.qkv(self.embed_tokens(input_ids).to(dtype), hidden, cos, sin, rows, self.product)
        return self.midlayer.finish(hidden if rows is None else hidden[:, rows], attention(q, k, v), self.product)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, valid: torch.Tensor,
                horizons: int, start: int = 0) -> list[torch.Tensor]:
        return self.ttt_forward(input_ids, aux, valid, horizons, start)

    def ttt_forward(self, input_ids: torch.Tensor, aux: torch.Tensor, valid: torch.Tensor,
                    horizons: int, start: int = 0) -> list[torch.Tensor]:
        """Training-time test over ``horizons`` steps; returns each step's output hidden state
        at positions ``start..T-1`` ([B, T-start, H] each).

        input_ids: [B, T] target tokens x; aux: [B, T, 3·Ht] target features at each
        position; valid: [B, T] real (non-pad) tokens, right-padded. ``logits`` of step k's
        output at t predict x[t+2+k]; they are left to the caller, which needs them only
        at the few positions that carry loss (the LM head is most of the head's cost).

        Why ``start``: step 0 at t needs keys of every earlier position, but a step's output
        at t feeds only the next step at the same t (later steps see their own diagonal),
        so positions before the first one with loss — the prompt, most of each row — need
        keys and values, never queries. Outputs from ``start`` on are exactly those of
        ``start=0``; attention shrinks from T×T to (T-start)×T.
        """
        b, t = input_ids.shape
        r = t - start
        dtype = aux.dtype
        device = input_ids.device
        positions = torch.arange(t, device=device).expand(b, t)
        hidden = self.fc(aux)  # [B, T, H]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()[start:]  # [R, T]
        step0 = causal[None] & valid[:, None, :]  # [B, R, T]
        diag = torch.eye(r, dtype=torch.bool, device=device).expand(b, r, r)
        keys, values, outputs = [], [], []
        for k in range(horizons):
            ids = torch.roll(input_ids, shifts=-(1 + k), dims=1)  # x[t+1+k] (wrapped tail is masked by callers)
            if k == 0:  # keys and values everywhere, queries from `start`
                cos, sin = self.rotary(positions, dtype)
                q, kk, vv = self.midlayer.qkv(self.embed_tokens(ids).to(dtype), hidden, cos, sin)
                q, hidden = q[:, :, start:], hidden[:, start:]
            else:
                cos, sin = self.rotary(positions[:, start:] + k, dtype)
                q, kk, vv = self.midlayer.qkv(self.embed_tokens(ids[:, start:]).to(dtype), hidden, cos, sin)
            keys.append(kk)
            values.append(vv)
            visible = torch.cat([step0] + [diag] * k, dim=-1)  # [B, R, T + R*k]
            attn = attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), visible)
            hidden = self.midlayer.finish(hidden, attn)
            outputs.append(hidden)
        return outputs


def _drop_embeddings(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    for key in [k for k in state if k.startswith(prefix + "embed_tokens.")]:
        del state[key]


def _keep_embeddings(module: nn.Module, state: dict, prefix: str, *args) -> None:
    state.setdefault(prefix + "embed_tokens.weight", module.embed_tokens.weight)


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` offsets and ``t2d`` mask for a sorted list of target ids."""
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_vocab_from_counts(counts: torch.Tensor, size: int, always: list[int] | None = None) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties: lower id first), sorted ascending.

    ``always`` (e.g. EOS) is included whatever its count.
    """
    counts = counts.clone().double()
    for i in always or []:
        counts[i] = float("inf")
    order = sorted(range(len(counts)), key=lambda i: (-counts[i].item(), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


# ------------------------------------------------------------------------- export
EXPORT_PREFIXES = ("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")


def export_config(c: HeadConfig) -> dict:
    """``config.json`` in the layout vLLM and SGLang read for ``LlamaForCausalLMEagle3``."""
    ids = engine_layer_ids(c.aux_layer_ids)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        # vLLM reads this key first, in HF numbering (the input of layer i)
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],
        "num_aux_hidden_states": len(ids["vllm"]),  # both engines size `fc` by it
        "eagle_config": {
            # SGLang reads only this key, and captures the input of layer id + 1
            "eagle_aux_hidden_state_layer_ids": ids["sglang"],
            "aux_hidden_state_layer_ids_convention": "sglang: id i = output of layer i = HF hidden_states[i + 1]",
        },
        "schemafill_aux_layer_ids": {"ids": list(c.aux_layer_ids), "convention": AUX_CONVENTION},
        "schemafill_head_config": asdict(c),
    }


def save_head(head: Eagle3Head, folder: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (no embeddings) into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items() if k.startswith(EXPORT_PREFIXES)}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(export_config(head.config), indent=2) + "\n")


def load_head(folder: str | Path, embed_tokens: nn.Embedding, inv_freq: torch.Tensor,
              attention_scaling: float = 1.0) -> Eagle3Head:
    """Read an exported head back; embeddings come from the target."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = json.loads((folder / "config.json").read_text())
    c = HeadConfig(**meta["schemafill_head_config"])
    head = Eagle3Head(c, embed_tokens, inv_freq, attention_scaling)
    missing, unexpected = head.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
    if missing or unexpected:
        raise ValueError(f"head at {folder} does not match its config: missing {missing}, unexpected {unexpected}")
    return head
