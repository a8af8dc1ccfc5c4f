"""A causal LM split at one decoder layer, for fine-tuning only its top layers cheaply.

When the embeddings and the lower ``split`` decoder layers are frozen, their output for an
example never changes during training: it is computed once (no grad) and every later visit
of the example runs only the trainable upper layers. On a CPU that computes in fp32 the
forward through the frozen layers is most of a training step, so an example seen again
costs a fraction of its first visit (the fewer layers train, the larger the saving;
``train=cpu`` trains 16 of the built-in target's 30, and its first visits dominate).

``upper_final_detached_context`` runs the top layers over a context (the prompt) without
grad and over the tail (the response) with it, reading the context's keys and values as a
KV cache: the same forward, with a backward pass over the response tokens only.

Works on the Hugging Face Llama-family layout (``model.model.{embed_tokens, layers, norm,
rotary_emb}``: Llama, Mistral, Qwen2, Qwen3). Batches are right-padded, so causal attention
alone keeps every real position exact: a real token never attends to a later (padding) one.
"""

from __future__ import annotations

from typing import Any

import torch


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] additive causal mask, for attention kernels other than SDPA's causal one."""
    t = hidden.shape[1]
    mask = torch.full((t, t), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=hidden.device).triu(1)
    return mask[None, None]  # [1, 1, T, T]


def run_layers(model: Any, hidden: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Decoder layers ``first .. last-1`` of ``model`` on ``hidden`` [B, T, H] (positions 0..T-1)."""
    inner = model.model
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]  # [1, T]
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    sdpa = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
    mask = None if sdpa else _causal_mask(hidden)  # no mask: SDPA runs its causal kernel
    for layer in inner.layers[first:last]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    return hidden


@torch.no_grad()
def lower_states(model: Any, input_ids: list[int], split: int) -> torch.Tensor:
    """[T, H] the input of layer ``split`` (HF ``hidden_states[split]``) for one example."""
    ids = torch.tensor([input_ids], device=model.device)  # [1, T]
    return run_layers(model, model.model.embed_tokens(ids), 0, split)[0]


def upper_final(model: Any, hidden: torch.Tensor, split: int) -> torch.Tensor:
    """[B, T, H] the final normed hidden states from the input of layer ``split`` on."""
    return model.model.norm(run_layers(model, hidden, split, len(model.model.layers)))


def pad_states(states: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad per-example [T_i, H] states into [B, T, H] (zeros after each example)."""
    width = max(s.shape[0] for s in states)
    out = states[0].new_zeros(len(states), width, states[0].shape[1])
    for i, s in enumerate(states):
        out[i, : s.shape[0]] = s
    return out


class _ContextKV:
    """Stands in for a transformers KV cache: the context pass records each layer's keys and
    values; the tail pass reads them in front of its own."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recording = True

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.recording:
            self.kv[layer_idx] = (key, value)
            return key, value
        k, v = self.kv[layer_idx]
        return torch.cat([k, key], dim=2), torch.cat([v, value], dim=2)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, Q, K] additive mask (finfo.min where not allowed) from a boolean [B, Q, K] one."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def upper_final_detached_context(model: Any, context: torch.Tensor, tail: torch.Tensor, mask: torch.Tensor,
                                 positions: torch.Tensor, split: int) -> torch.Tensor:
    """[B, R, H] final normed states of the tails, the contexts before them run without grad.

    ``context`` [B, C, H] (left-padded) and ``tail`` [B, R, H] (right-padded) are inputs of
    layer ``split``; ``mask`` [B, C + R] marks real positions and ``positions`` [B, C + R]
    their position ids. The forward is the exact one; the gradient leaves out what flows
    through the contexts' keys and values."""
    inner = model.model
    c, r = context.shape[1], tail.shape[1]
    real = mask.bool()  # [B, C + R]
    causal = torch.ones(c + r, c + r, dtype=torch.bool, device=mask.device).tril()  # [C + R, C + R]
    allowed = causal[None] & real[:, None, :]  # [B, C + R, C + R]: query i sees real keys j <= i
    # a padding query sees itself too: no row is all masked, so no softmax can turn NaN where a
    # low-precision kernel rounds the mask to -inf (real queries never see padding keys)
    allowed |= torch.eye(c + r, dtype=torch.bool, device=mask.device)[None]
    kv = _ContextKV()
    with torch.no_grad():
        rotary = inner.rotary_emb(context, position_ids=positions[:, :c])
        hidden, context_mask = context, _additive(allowed[:, :c, :c], context.dtype)
        for layer in inner.layers[split:]:
            hidden = layer(hidden, attention_mask=context_mask, position_embeddings=rotary,
                           position_ids=positions[:, :c], cache=kv)
    if len(kv.kv) != len(inner.layers) - split:  # a transformers whose layers take the cache under another name
        raise RuntimeError(f"the decoder layers stored {len(kv.kv)} of {len(inner.layers) - split} layers' keys "
                           "and values: this transformers version does not pass `cache=` to attention")
    kv.recording = False
    rotary = inner.rotary_emb(tail, position_ids=positions[:, c:])
    hidden, tail_mask = tail, _additive(allowed[:, c:], tail.dtype)
    for layer in inner.layers[split:]:
        hidden = layer(hidden, attention_mask=tail_mask, position_embeddings=rotary,
                       position_ids=positions[:, c:], cache=kv)
    return inner.norm(hidden)
