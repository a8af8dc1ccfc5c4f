"""Supervised fine-tuning of a target on tool-call responses (stage `target`).

Examples (``train.sft_data``) are prompt + canonical reference response, loss on response
tokens only. The loop
is Accelerate's, in fp32 on a CPU unless a timed probe finds bf16 autocast faster
(``schemafill/precision.py``: the same CPU flags mean 5x faster on one host, 1.5x slower on
another, and 30x slower where bf16 is emulated), and is budgeted by steps *and* wall time, so `make run`
stays inside its time box on a 2-core machine; no step starts that would end past it.
Measured savings on CPU: frozen embeddings (tied to the LM head in SmolLM2); frozen lower
layers, whose backward pass is never built and whose output is computed once per example
(``train.layer_split``); logits only where the loss needs them; and, with
``context_grad=false``, prompts run forward without grad, so only the responses (a sixth
of the tokens) pay for a backward pass.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from schemafill.config import TargetTrainConfig
from train.layer_split import lower_states, pad_states, upper_final, upper_final_detached_context
from train.sft_data import Example, batches, collate, split_collate


def loss_at_responses(final: torch.Tensor, labels: torch.Tensor, lm_head: Any,
                      decisions: torch.Tensor | None = None, decision_weight: float = 1.0) -> torch.Tensor:
    """Next-token cross-entropy on response positions only, logits computed only there.

    ``final`` [B, T, H], ``labels`` [B, T]; ``decisions`` [B, T] marks the labels that are
    closing decisions, weighted ``decision_weight`` times the others in the mean."""
    targets = labels[:, 1:]  # [B, T-1]: token t+1 is predicted at position t
    keep = targets != -100
    logits = lm_head(final[:, :-1][keep])  # [N, V]
    if decisions is None or decision_weight == 1.0:
        return F.cross_entropy(logits.float(), targets[keep])
    losses = F.cross_entropy(logits.float(), targets[keep], reduction="none")  # [N]
    weights = 1.0 + (decision_weight - 1.0) * decisions[:, 1:][keep].float()  # [N]
    return (losses * weights).sum() / weights.sum()


def response_loss(model: Any, batch: dict[str, torch.Tensor], decision_weight: float = 1.0) -> torch.Tensor:
    """The loss through the whole model (no frozen-layer cache)."""
    final = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return loss_at_responses(final, batch["labels"], model.lm_head, batch.get("decisions"), decision_weight)


def frozen_layers(model: Any, train: TargetTrainConfig) -> int:
    """How many lower decoder layers stay frozen (0 when every layer trains)."""
    layers = len(model.model.layers)
    keep = layers if train.trainable_layers <= 0 else min(train.trainable_layers, layers)
    return layers - keep


def freeze(model: Any, train: TargetTrainConfig) -> int:
    """Freeze embeddings and all but the top ``trainable_layers``; return trainable params."""
    if train.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    for layer in model.model.layers[: frozen_layers(model, train)]:
        layer.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lr_factor(progress: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% as ``progress`` (steps or time) goes 0 → 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class Progress:
    """Where a fine-tune stands; saved with its checkpoint, so a rerun continues it."""

    steps: int = 0
    batches: int = 0  # drawn from the example stream; a resumed run skips them
    seconds: float = 0.0  # training wall time, summed over every run
    tokens: int = 0  # real (unpadded) tokens trained on
    losses: list[float] = field(default_factory=list)
    # seconds per token of the last steps, for the budget's estimate of the next one
    lower_rate: float = 0.0  # frozen layers, once per example
    upper_rate: float = 0.0  # trained layers (the whole model without the cache), every visit


class StepCost:
    """Predicts a step's seconds from the steps so far, so no step starts that would end past
    the budget. Per-token rates of the frozen-layer pass (paid on an example's first visit)
    and of the trained pass are kept apart: first visits cost several times later ones."""

    margin = 1.15  # steps vary with padding and cache state; err on the side of the budget

    def __init__(self, progress: Progress, window: int = 5) -> None:
        self.progress, self.window = progress, window
        self.lower: list[float] = [progress.lower_rate] if progress.lower_rate else []
        self.upper: list[float] = [progress.upper_rate] if progress.upper_rate else []

    def observe(self, lower_tokens: int, lower_s: float, upper_tokens: int, upper_s: float) -> None:
        if lower_tokens:
            self.lower = (self.lower + [lower_s / lower_tokens])[-self.window:]
            self.progress.lower_rate = self.lower[-1]
        self.upper = (self.upper + [upper_s / upper_tokens])[-self.window:]
        self.progress.upper_rate = self.upper[-1]

    def predict(self, lower_tokens: int, upper_tokens: int) -> float | None:
        """Seconds the next step will take, or None before any step has been measured."""
        if not self.upper or (lower_tokens and not self.lower):
            return None
        lower = max(self.lower) * lower_tokens if lower_tokens else 0.0
        return self.margin * (lower + max(self.upper) * upper_tokens)


class LowerCache:
    """The frozen layers' output (input of the first trained layer) per example, computed on
    its first visit and reused on every later one."""

    def __init__(self, model: Any, split: int, examples: list[Example]) -> None:
        self.model, self.split = model, split
        self.index = {id(e): i for i, e in enumerate(examples)}
        self.states: dict[int, torch.Tensor] = {}

    def missing_tokens(self, group: list[Example]) -> int:
        return sum(len(e.input_ids) for e in group if self.index[id(e)] not in self.states)

    def fill(self, group: list[Example]) -> None:
        for e in group:
            key = self.index[id(e)]
            if key not in self.states:
                self.states[key] = lower_states(self.model, e.input_ids, self.split)

    def get(self, e: Example) -> torch.Tensor:
        return self.states[self.index[id(e)]]

    def batch(self, group: list[Example]) -> torch.Tensor:
        """[B, T, H] right-padded states of ``group``."""
        self.fill(group)
        return pad_states([self.get(e) for e in group])


def detached_context_loss(model: Any, batch: dict[str, Any], states: list[torch.Tensor] | None,
                          split: int, decision_weight: float = 1.0) -> torch.Tensor:
    """The response loss of a ``split_collate`` batch, its contexts run without grad.

    ``states`` are the examples' [T_i, H] inputs of layer ``split`` (the frozen layers'
    cache), or None with ``split`` 0 (the embeddings, looked up here). The loss is the exact
    one; its gradient leaves out the path through the contexts' keys and values. Most of an
    example's tokens are prompt, so a step costs a forward pass over them plus a backward
    pass over the responses only."""
    c, ids, mask = batch["context"], batch["input_ids"], batch["attention_mask"]
    if states is None:
        hidden = model.model.embed_tokens(ids)  # [B, C + R, H]
    else:  # the cached states in split_collate's layout: contexts end at column C, tails start there
        hidden = states[0].new_zeros(*ids.shape, states[0].shape[-1])  # [B, C + R, H]
        for i, row in enumerate(states):
            first = c - int(mask[i, :c].sum())  # where the left-padded context begins
            hidden[i, first:first + row.shape[0]] = row
    final = upper_final_detached_context(model, hidden[:, :c], hidden[:, c:], mask, batch["position_ids"], split)
    return loss_at_responses(final, batch["labels"], model.lm_head, batch.get("decisions"), decision_weight)


def finetune(model: Any, tokenizer: Any, examples: list[Example], train: TargetTrainConfig, seed: int,
             tracker: Any, autocast_bf16: bool, progress: Progress | None = None,
             optimizer_state: dict | None = None, checkpoint: Callable[[Progress, dict], None] | None = None) -> dict:
    """Train in place until ``max_steps`` or ``max_minutes``; return the run's statistics.

    ``progress`` and ``optimizer_state`` (from an earlier run's ``checkpoint``) continue that
    run: its steps, time and example stream go on where they stopped. ``checkpoint`` is
    called every ``train.checkpoint_minutes`` and at the end with what a rerun needs.
    """
    from accelerate import Accelerator

    # autocast by hand rather than Accelerator(mixed_precision=...): Accelerate's state is a
    # process-wide singleton, and the pipeline runs other Accelerate stages in this process
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(seed)
    trainable = freeze(model, train)
    split = frozen_layers(model, train) if train.cache_frozen and train.freeze_embeddings else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    model, optimizer = accelerator.prepare(model, optimizer)
    raw = accelerator.unwrap_model(model)
    model.train()
    progress = progress or Progress()
    resumed_from = progress.steps
    stream = batches(examples, train.batch_tokens, seed)
    for _ in range(progress.batches):  # the batches the earlier runs trained on
        next(stream)
    cache = LowerCache(raw, split, examples) if split else None
    cost = StepCost(progress)
    budget = train.max_minutes * 60
    last_save = run_start = time.perf_counter()
    stop = "max_steps"
    bar = tqdm(total=train.max_steps, initial=progress.steps, desc="fine-tune target", unit="step",
               dynamic_ncols=True)
    while progress.steps < train.max_steps:
        group = next(stream)
        batch = (collate if train.context_grad else split_collate)(group, tokenizer.pad_token_id)
        padded = batch["input_ids"].numel()
        missing = cache.missing_tokens(group) if cache else 0
        expected = cost.predict(missing, padded)
        elapsed = progress.seconds + time.perf_counter() - run_start
        if elapsed >= budget or (expected is not None and elapsed + expected > budget):
            stop = "max_minutes"
            break
        fraction = max(progress.steps / train.max_steps, elapsed / budget)
        for g in optimizer.param_groups:
            g["lr"] = train.lr * lr_factor(fraction, progress.steps, train.warmup_steps)
        t0 = time.perf_counter()
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            if cache:
                cache.fill(group)
            t1 = time.perf_counter()
            w = train.decision_weight
            if not train.context_grad:
                loss = detached_context_loss(raw, batch, [cache.get(e) for e in group] if cache else None, split, w)
            elif cache:
                loss = loss_at_responses(upper_final(raw, cache.batch(group), split), batch["labels"], raw.lm_head,
                                         batch["decisions"], w)
            else:
                loss = response_loss(raw, batch, w)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        cost.observe(missing, t1 - t0, padded, t2 - t1)
        progress.steps += 1
        progress.batches += 1
        progress.tokens += int(batch["attention_mask"].sum())
        progress.losses.append(round(loss.item(), 4))
        now = time.perf_counter()
        elapsed = progress.seconds + now - run_start
        bar.update(1)
        bar.set_postfix(loss=f"{progress.losses[-1]:.3f}", tok_s=f"{progress.tokens / elapsed:.0f}",
                        min=f"{elapsed / 60:.1f}")
        tracker.log({"target/step": progress.steps, "target/loss": progress.losses[-1],
                     "target/lr": optimizer.param_groups[0]["lr"], "target/tokens_per_s": progress.tokens / elapsed})
        if checkpoint is not None and now - last_save > train.checkpoint_minutes * 60:
            checkpoint(_advance(progress, now - run_start), optimizer.state_dict())
            run_start = last_save = now
    bar.close()
    model.eval()
    progress = _advance(progress, time.perf_counter() - run_start)
    if checkpoint is not None:
        checkpoint(progress, optimizer.state_dict())
    tail = progress.losses[-10:] or [float("nan")]
    return {"steps": progress.steps, "resumed_from_step": resumed_from, "stopped_by": stop,
            "train_seconds": round(progress.seconds, 1), "tokens": progress.tokens,
            "tokens_per_s": round(progress.tokens / max(progress.seconds, 1e-9), 1), "trainable_params": trainable,
            "frozen_layers_cached": split, "examples_cached": len(cache.states) if cache else 0,
            "bf16_autocast": autocast_bf16, "final_loss": sum(tail) / len(tail),
            "first_loss": progress.losses[0] if progress.losses else None}


def _advance(progress: Progress, seconds: float) -> Progress:
    """``progress`` with ``seconds`` more training time (it is mutated in place and returned)."""
    progress.seconds = round(progress.seconds + seconds, 3)
    return progress
