"""Batched greedy generation with a Hugging Face model, under the shared stopping rule.

Used where throughput over many requests matters more than per-request latency: the
target's continuations of the training pool and quick quality checks. Prompts are sorted
by length and left-padded into batches; each row stops on its own (``ResponseStop``).
Timed, per-request decoding for evaluation belongs to the inference runtime, not here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache

from schemafill.stopping import ResponseStop, eos_token_ids


@dataclass(frozen=True)
class Generation:
    ids: list[int]  # response token ids (EOS included when it ended the response)
    text: str  # response text, special tokens skipped
    stop: str  # closed | eos | length


@torch.inference_mode()
def generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
    """Greedy responses for one batch of prompt ids (left-padded here).

    A hand-written loop rather than ``model.generate``: rows leave the batch (and the KV
    cache) as soon as they stop, so one runaway response does not make the whole batch
    pay for the length cap.
    """
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    stops = [ResponseStop(tokenizer, eos, max_new_tokens) for _ in prompts]
    rows = list(range(len(prompts)))  # batch row -> prompt index, for rows still decoding
    cache = DynamicCache()
    # transformers 5 renamed `past_key_values` to `cache`; accept both generations of the API
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                logits_to_keep=1, **{cache_kw: cache})
    while True:
        nxt = out.logits[:, -1].argmax(-1)  # [B]
        for r, tok in zip(rows, nxt.tolist()):
            stops[r].push([tok])
        keep = [i for i, r in enumerate(rows) if not stops[r].done]
        if not keep:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attention, positions, nxt = attention[index], positions[index], nxt[index]
            rows = [rows[i] for i in keep]
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=attention, position_ids=positions, use_cache=True,
                    **{cache_kw: cache})
    return [Generation(ids=list(s.ids), text=s.text, stop=s.reason or "length") for s in stops]


def generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             on_batch: Callable[[list[int], list[Generation]], None] | None = None) -> list[Generation]:
    """Greedy responses for every prompt, in input order; ``on_batch(indices, generations)``
    is called after each batch (progress bars, incremental saving)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Generation | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        gens = generate_batch(model, tokenizer, [prompts[i] for i in idx], max_new_tokens)
        for i, g in zip(idx, gens):
            out[i] = g
        if on_batch is not None:
            on_batch(idx, gens)
    return out  # type: ignore[return-value]
