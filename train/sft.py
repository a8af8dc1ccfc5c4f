"""Supervised fine-tuning of a target on tool-call responses (stage `target`).

Examples are prompt + canonical reference response, loss on response tokens only. The
loop is Accelerate's (bf16 autocast on CPU is ~1.5x faster than fp32 here and is what
``train.target.bf16_autocast_cpu`` turns on) and is budgeted by steps *and* wall time, so
`make run` stays inside its time box on a 2-core machine. Two measured savings on CPU:
frozen embeddings (tied to the LM head in SmolLM2) and frozen lower layers, whose
backward pass is then never built; logits are computed only where the loss needs them.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from schemafill.compose import compositions
from schemafill.config import ModelConfig, TargetTrainConfig
from schemafill.prompt import prompt_ids, response_ids
from schemafill.toolcall import ToolRequest, serialize_calls


@dataclass(frozen=True)
class Example:
    id: str
    input_ids: list[int]  # prompt + response
    prompt_len: int
    calls: int


def build_examples(requests: list[ToolRequest], tokenizer: Any, model: ModelConfig, train: TargetTrainConfig,
                   seed: int) -> tuple[list[Example], dict]:
    """Tokenized SFT examples: referenced requests plus multi-call compositions of them."""
    referenced = [r for r in requests if r.reference]
    # BFCL450 averages 3.1 calls: weight 3- and 4-call compositions, and compose parts with
    # small catalogs so the composed prompts fit max_seq_len instead of being skipped
    composed = compositions(referenced, int(len(referenced) * train.compositions), seed=seed, prefix="sft_composed",
                            same_tool_share=0.6, sizes=(2, 3, 4, 4, 4), max_catalog=train.compose_max_catalog)
    examples, too_long = [], 0
    for req in referenced + composed:
        ids = prompt_ids(req, model.prompt_style, tokenizer, model.chat_template_kwargs)
        resp = response_ids(serialize_calls(req.reference), tokenizer)
        if len(ids) + len(resp) > train.max_seq_len:
            too_long += 1  # never truncated: a cut response would teach a broken format
            continue
        examples.append(Example(req.id, ids + resp, len(ids), len(req.reference)))
    # Most corpus requests need one call; BFCL450 needs 2-4 (3.1 on average). Left as is, the
    # model learns one call as its prior (measured: 1.1 calls per response against 3.1), so
    # examples are resampled to `call_mix` shares of 1, 2, 3 and 4+ calls.
    buckets: list[list[Example]] = [[] for _ in train.call_mix]
    for e in examples:
        buckets[min(e.calls, len(buckets)) - 1].append(e)
    empty = [i + 1 for i, (b, share) in enumerate(zip(buckets, train.call_mix)) if share > 0 and not b]
    if empty:
        raise ValueError(f"no fine-tuning examples with {empty} call(s) fit max_seq_len={train.max_seq_len}; "
                         "raise train.target.max_seq_len or set their train.target.call_mix share to 0")
    total = min(len(b) / share for b, share in zip(buckets, train.call_mix) if share > 0)
    rng = random.Random(seed)
    examples = [e for b, share in zip(buckets, train.call_mix) for e in rng.sample(b, int(total * share))]
    stats = {"referenced": len(referenced), "composed": len(composed), "examples": len(examples),
             "examples_by_calls": {f"{i + 1}{'+' if i + 1 == len(buckets) else ''}": int(total * share)
                                   for i, share in enumerate(train.call_mix)},
             "mean_calls": sum(e.calls for e in examples) / max(len(examples), 1),
             "skipped_too_long": too_long, "max_seq_len": train.max_seq_len}
    return examples, stats


def batches(examples: list[Example], batch_tokens: int, seed: int):
    """Endless stream of length-grouped batches of at most ``batch_tokens`` padded tokens."""
    if not examples:
        raise ValueError("no examples to train on")
    rng = random.Random(seed)
    while True:
        order = examples[:]
        rng.shuffle(order)
        chunk = 64  # sort within chunks: little padding, still shuffled across the epoch
        groups = []
        for i in range(0, len(order), chunk):
            part = sorted(order[i:i + chunk], key=lambda e: len(e.input_ids))
            group: list[Example] = []
            for ex in part:
                width = max([len(ex.input_ids)] + [len(g.input_ids) for g in group])
                if group and width * (len(group) + 1) > batch_tokens:
                    groups.append(group)
                    group = []
                group.append(ex)
            if group:
                groups.append(group)
        rng.shuffle(groups)
        yield from groups


def collate(group: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(group), width), -100, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(group), width), dtype=torch.long)  # [B, T]
    for i, e in enumerate(group):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, e.prompt_len:n] = ids[i, e.prompt_len:n]
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def response_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy on response positions only, logits computed only there."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]  # [B, T-1]: token t+1 is predicted at position t
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]
    return F.cross_entropy(logits.float(), targets[keep])


def freeze(model: Any, train: TargetTrainConfig) -> int:
    """Freeze embeddings and all but the top ``trainable_layers``; return trainable params."""
    if train.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    layers = model.model.layers
    keep = len(layers) if train.trainable_layers <= 0 else min(train.trainable_layers, len(layers))
    for layer in layers[: len(layers) - keep]:
        layer.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lr_factor(progress: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% as ``progress`` (steps or time) goes 0 → 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def finetune(model: Any, tokenizer: Any, examples: list[Example], train: TargetTrainConfig, seed: int,
             tracker: Any) -> dict:
    """Train in place until ``max_steps`` or ``max_minutes``; return the run's statistics."""
    from accelerate import Accelerator

    use_bf16 = torch.cuda.is_available() or train.bf16_autocast_cpu
    # autocast by hand rather than Accelerator(mixed_precision=...): Accelerate's state is a
    # process-wide singleton, and the pipeline runs other Accelerate stages in this process
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(seed)
    trainable = freeze(model, train)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    stream = batches(examples, train.batch_tokens, seed)
    budget = train.max_minutes * 60
    t0 = time.perf_counter()
    tokens = steps = 0
    losses: list[float] = []
    bar = tqdm(total=train.max_steps, desc="fine-tune target", unit="step", dynamic_ncols=True)
    while steps < train.max_steps and time.perf_counter() - t0 < budget:
        batch = {k: v.to(accelerator.device) for k, v in collate(next(stream), tokenizer.pad_token_id).items()}
        progress = max(steps / train.max_steps, (time.perf_counter() - t0) / budget)
        for group in optimizer.param_groups:
            group["lr"] = train.lr * lr_factor(progress, steps, train.warmup_steps)
        with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = response_loss(accelerator.unwrap_model(model), batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        tokens += int(batch["attention_mask"].sum())
        losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / elapsed:.0f}", min=f"{elapsed / 60:.1f}")
        tracker.log({"target/step": steps, "target/loss": losses[-1], "target/lr": optimizer.param_groups[0]["lr"],
                     "target/tokens_per_s": tokens / elapsed})
    bar.close()
    model.eval()
    seconds = time.perf_counter() - t0
    tail = losses[-10:] or [float("nan")]
    return {"steps": steps, "train_seconds": round(seconds, 1), "tokens": tokens,
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "trainable_params": trainable,
            "final_loss": sum(tail) / len(tail), "first_loss": losses[0] if losses else None}
