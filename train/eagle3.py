"""Stage `head`: train the target's EAGLE-3 draft head on its own continuations.

Reads ``artifacts/continuations/<model>/``; holds out a seeded 5% of rows; picks the draft
vocabulary (the most frequent loss-masked tokens, cached by tokenizer + data fingerprint);
trains with training-time test over ``drafter.horizons`` steps in an Accelerate loop
(AdamW, warm-up + cosine, clipping, accumulation; DeepSpeed through an Accelerate config),
checkpointing every ``save_every`` optimizer steps and resuming from the last checkpoint;
exports to ``artifacts/heads/<model>/`` in the layout vLLM/SGLang load, with
``train_metrics.json`` (held-out loss and top-1 accuracy per horizon).

The target runs frozen: online per batch, or once into a feature cache that every epoch
reads (``train.head.feature_cache``; on a CPU the target forward dominates, so caching
pays from the second epoch on).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from schemafill import atomic
from schemafill.config import PipelineConfig, to_dict
from schemafill.contract.stopping import eos_token_ids
from schemafill.fingerprint import fingerprint, load_if_fresh, read_manifest, write_manifest
from schemafill.runtime.device import TRAIN_PROBE_ROWS, train_precision
from schemafill.runtime.drafter import Eagle3Head, HeadConfig, draft_vocab_from_counts, save_head
from schemafill.runtime.feature_cache import FEATURES, FeatureCache, Features
from schemafill.runtime.loading import decode_choice, from_hf_model, load_model, load_tokenizer, target_location
from train.features import target_features
from train.losses import ttt_loss

OUTPUTS = ["config.json", "model.safetensors", "train_metrics.json"]


def heads_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.paths.artifacts) / "heads" / cfg.run_name


def split_rows(ids: list[str], heldout_fraction: float) -> tuple[list[int], list[int]]:
    """Indices of training and held-out rows, decided by a hash of each row id."""
    train, held = [], []
    for i, rid in enumerate(ids):
        bucket = int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if bucket < heldout_fraction else train).append(i)
    return train, held


def draft_vocab(rows: list[dict], train_idx: list[int], vocab_size: int, size: int, always: list[int],
                cache: Path) -> torch.Tensor:
    if cache.is_file():
        return torch.load(cache)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in train_idx:
        ids = torch.tensor(rows[i]["input_ids"])
        counts += torch.bincount(ids[torch.tensor(rows[i]["loss_mask"]).bool()], minlength=vocab_size)
    vocab = draft_vocab_from_counts(counts, size, always=always)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(cache) as tmp:
        torch.save(vocab, tmp)
    return vocab


def new_head(target: Any, size: int, aux_layer_ids: list[int], vocab: torch.Tensor) -> Eagle3Head:
    """A head shaped like one target layer; ``lm_head`` and ``norm`` start from the target's."""
    config = HeadConfig.from_target(target.config, size, aux_layer_ids)
    embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone(), freeze=True)
    rotary = target.model.rotary_emb
    head = Eagle3Head(config, embed, rotary.inv_freq.detach().clone(), float(getattr(rotary, "attention_scaling", 1.0)))
    for module in (head.fc, head.midlayer):
        for p in module.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=getattr(target.config, "initializer_range", 0.02))
    head.set_vocab(vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab])
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def batches(lengths: list[int], indices: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of length-grouped batches, shuffled deterministically by (seed, epoch)."""
    rng = random.Random(seed * 1000 + epoch)
    order = indices[:]
    rng.shuffle(order)
    groups = []
    for i in range(0, len(order), 32 * batch_size):
        chunk = sorted(order[i:i + 32 * batch_size], key=lambda j: lengths[j])
        groups += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(groups)
    return groups


class Batcher:
    """Turns row indices into tensors plus the target's features (cached or online)."""

    def __init__(self, rows: list[dict], target: Any, cache: FeatureCache | None, aux_layer_ids: list[int],
                 vocab: torch.Tensor, max_len: int, device: torch.device) -> None:
        self.rows, self.target, self.cache = rows, target, cache
        self.aux_layer_ids, self.vocab, self.max_len, self.device = aux_layer_ids, vocab, max_len, device
        self.draft_lm_head = target.lm_head.weight[vocab].detach()  # [Vd, Ht], gathered once

    def __call__(self, idx: list[int]) -> dict[str, torch.Tensor]:
        width = min(self.max_len, max(len(self.rows[i]["input_ids"]) for i in idx))
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros(len(idx), width, dtype=torch.long)  # [B, T]
        valid = torch.zeros(len(idx), width, dtype=torch.bool)  # [B, T]
        for b, i in enumerate(idx):
            row = self.rows[i]
            n = min(width, len(row["input_ids"]))
            ids[b, :n] = torch.tensor(row["input_ids"][:n])
            loss_mask[b, :n] = torch.tensor(row["loss_mask"][:n])
            valid[b, :n] = True
        ids, loss_mask, valid = ids.to(self.device), loss_mask.to(self.device), valid.to(self.device)
        if self.cache is not None:
            f = self.cache.batch(idx, width)
            f = Features(f.aux.to(self.device), f.final.to(self.device), f.argmax.to(self.device))
        else:
            f = target_features(self.target, ids, valid.long(), self.aux_layer_ids)
        return {"input_ids": ids, "loss_mask": loss_mask, "valid": valid, "aux": f.aux.float(),
                "target_final": f.final, "target_argmax": f.argmax}

    def target_logits(self, final: torch.Tensor) -> torch.Tensor:
        """[N, Ht] target final hidden states -> [N, Vd] its logits at the draft ids."""
        weight = self.draft_lm_head  # [Vd, Ht]
        return final.to(weight.dtype) @ weight.T


def run_ttt(model: Any, head: Eagle3Head, batcher: "Batcher", batch: dict, horizons: int, decay: float):
    """``model`` is what runs the forward (DDP-wrapped when distributed); ``head`` the bare head.

    Queries start ``horizons + 1`` positions before the batch's first loss-carrying token
    (step k at t predicts x[t+2+k]): the prompt before it contributes keys only."""
    first = int(batch["loss_mask"].any(0).nonzero()[0]) if bool(batch["loss_mask"].any()) else 0
    start = max(0, first - 1 - horizons)
    outputs = model(batch["input_ids"], batch["aux"], batch["valid"], horizons, start)
    return ttt_loss(outputs, head.logits, batch["target_final"][:, start:], batcher.target_logits,
                    batch["target_argmax"][:, start:], batch["loss_mask"][:, start:],
                    head.t2d, head.draft_to_target, decay)


@torch.no_grad()
def evaluate(head: Eagle3Head, batcher: Batcher, lengths: list[int], held: list[int], cfg: PipelineConfig) -> dict:
    head.eval()
    loss_sum, correct, count, n = 0.0, Counter(), Counter(), 0
    for idx in batches(lengths, held, cfg.train.head.batch_size, 0, 0):
        res = run_ttt(head, head, batcher, batcher(idx), cfg.drafter.horizons, cfg.drafter.loss_decay)
        loss_sum += res.loss.item()
        n += 1
        for k in range(cfg.drafter.horizons):
            correct[k] += res.step_correct[k]
            count[k] += res.step_count[k]
    head.train()
    return {"heldout_loss": loss_sum / max(n, 1),
            "heldout_acc": [correct[k] / count[k] if count[k] else 0.0 for k in range(cfg.drafter.horizons)],
            "heldout_positions": [count[k] for k in range(cfg.drafter.horizons)]}


def captured_features(cont: Path, aux_layer_ids: list[int], dtype: torch.dtype, rows: int) -> FeatureCache | None:
    """The features the continuations stage kept while it generated the rows, when they
    came from these aux layers at this dtype (else None: the head stage computes its own)."""
    folder = cont / FEATURES
    if not FeatureCache.exists(folder):
        return None
    cache = FeatureCache(folder)
    source = cache.meta.get("source", {})
    if source.get("aux_layer_ids") != list(aux_layer_ids) or source.get("dtype") != str(dtype) \
            or len(cache.offsets) != rows + 1:
        return None
    return cache


class Budget:
    """Where training stands on its schedule: the share of its steps or of its time budget
    (``train.head.max_minutes``; 0: none) done, whichever is further along. With a budget
    the cosine decays with the clock, so a slow host still ends at a low learning rate; the
    ranks take the slowest rank's clock, so they all step alike and stop together."""

    def __init__(self, steps: int, seconds: float) -> None:
        self.steps, self.limit = steps, seconds
        self.spent = 0.0  # seconds before this launch (a resumed run)
        self.seconds = 0.0  # seconds so far, as every rank agrees
        self._accelerator, self._t0 = None, 0.0

    def start(self, accelerator: Any) -> None:
        self._accelerator, self._t0 = accelerator, time.perf_counter()
        self.seconds = self.spent

    def tick(self) -> None:
        if not self.limit:
            return
        mine = torch.tensor([self.spent + time.perf_counter() - self._t0], device=self._accelerator.device)
        self.seconds = float(self._accelerator.reduce(mine, "max")[0])

    def progress(self, step: int) -> float:
        done = min(step / self.steps, 1.0)
        return max(done, min(self.seconds / self.limit, 1.0)) if self.limit else done

    @property
    def over(self) -> bool:
        return bool(self.limit) and self.seconds >= self.limit


def latest_checkpoint(folder: Path) -> tuple[Path | None, int]:
    steps = [(int(p.name.split("_")[1]), p) for p in folder.glob("step_*") if (p / "progress.json").is_file()]
    if not steps:
        return None, 0
    step, path = max(steps)
    return path, step


def build_head(cfg: PipelineConfig, tracker: Any = None) -> dict:
    import datasets
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    hc, dc = cfg.train.head, cfg.drafter
    cont = Path(cfg.paths.artifacts) / "continuations" / cfg.run_name
    if not (cont / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{cont} missing: run the `continuations` stage first")
    out = heads_dir(cfg)
    data_fp = (read_manifest(cont) or {}).get("fingerprint", "unknown")
    location = target_location(cfg.model, cfg.paths.artifacts)
    fp = fingerprint({"model": to_dict(cfg.model), "target": (read_manifest(location) or {}).get("fingerprint", location),
                      "drafter": to_dict(dc), "train": to_dict(hc), "data": data_fp, "seed": cfg.seed, "recipe": 1})
    if (metrics := load_if_fresh("head", out, fp, OUTPUTS, "train_metrics.json",
                                 lambda m: f"held-out acc {m['heldout_acc']}")) is not None:
        return {**metrics, "cached": True}

    # the scheduler steps once per optimizer step, whatever the process count (Accelerate's
    # default would step it num_processes times and end the cosine early)
    accelerator = Accelerator(gradient_accumulation_steps=hc.grad_accum, cpu=not torch.cuda.is_available(),
                              step_scheduler_with_optimizer=False)
    set_seed(cfg.seed)
    rows = datasets.load_from_disk(str(cont)).to_list()
    # rows whose response starts beyond max_seq_len would only be truncated prompts: nothing to learn
    fits = [i for i, r in enumerate(rows) if r["prompt_len"] + 2 < hc.max_seq_len]
    train_idx, held_idx = split_rows([rows[i]["id"] for i in fits], hc.heldout_fraction)
    train_idx, held_idx = [fits[i] for i in train_idx], [fits[i] for i in held_idx]
    tokenizer = load_tokenizer(location, cfg.model.revision)
    target = load_model(location, decode_choice(cfg.model, location, accelerator.device, verifies=False)[0], accelerator.device,
                        cfg.model.revision)
    target.requires_grad_(False)
    vocab_size = target.config.vocab_size
    size = min(dc.draft_vocab_size, vocab_size)
    vocab = draft_vocab(rows, train_idx, vocab_size, size, sorted(eos_token_ids(tokenizer, target.generation_config)),
                        out.parent / ".vocab" / f"{cfg.model.name}-{fingerprint([data_fp, vocab_size, size, tokenizer.name_or_path])}.pt")
    cache = captured_features(cont, cfg.model.aux_layer_ids, target.dtype, len(rows)) if hc.feature_cache else None
    if hc.feature_cache and cache is None:
        key = fingerprint([data_fp, cfg.model.aux_layer_ids, str(target.dtype), hc.max_seq_len, "runtime"])
        folder = out.parent / ".features" / f"{cfg.model.name}-{key}"
        if not FeatureCache.exists(folder):
            if accelerator.is_main_process:
                ids = [r["input_ids"][: hc.max_seq_len] for r in rows]
                FeatureCache.build(folder, from_hf_model(target, cfg.model.aux_layer_ids), ids,
                                   [min(r["prompt_len"] - 1, len(x) - 1) for r, x in zip(rows, ids)])
            accelerator.wait_for_everyone()
        cache = FeatureCache(folder)
    if cache is not None:
        print(f"[head] target features from {cache.folder}")
    batcher = Batcher(rows, target, cache, cfg.model.aux_layer_ids, vocab.to(accelerator.device), hc.max_seq_len,
                      accelerator.device)

    head = new_head(target, size, cfg.model.aux_layer_ids, vocab).to(accelerator.device)
    # fp32 master weights; on a CPU bf16 only by autocast, where the train probe finds it faster
    precision = train_precision(hc.bf16_autocast_cpu, accelerator.device, target.config, TRAIN_PROBE_ROWS)
    autocast = accelerator.device.type == "cpu" and precision.bf16
    print(f"[head] precision: {'bf16 autocast' if autocast else 'fp32'} ({precision.why}; "
          f"train.head.bf16_autocast_cpu={hc.bf16_autocast_cpu})")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=hc.lr, weight_decay=0.0)
    lengths = [len(r["input_ids"]) for r in rows]
    # every rank gets the same number of batches (the tail that would not divide is dropped),
    # so gradient all-reduces and checkpoints stay in step across ranks
    per_epoch = max(1, math.ceil(len(train_idx) / hc.batch_size) // accelerator.num_processes)
    total_steps = max(1, hc.epochs * per_epoch // hc.grad_accum)
    warmup = max(1, int(hc.warmup_ratio * total_steps))
    budget = Budget(total_steps, 60 * hc.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * budget.progress(s)))))
    head, optimizer, scheduler = accelerator.prepare(head, optimizer, scheduler)

    ckpt_root = out.parent / ".checkpoints" / f"{cfg.model.name}-{fp}-p{accelerator.num_processes}"
    resume, done_steps = latest_checkpoint(ckpt_root)
    resumed_from = done_steps
    micro_done = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        progress = json.loads((resume / "progress.json").read_text())
        micro_done = progress["micro_steps"]
        budget.spent = progress.get("seconds", 0.0)
        # the precision the first steps took, not this launch's probe (another thread count or a
        # busy host may time it the other way): one run, one precision
        autocast = progress.get("autocast", autocast)
        if accelerator.is_main_process:
            print(f"[head] resuming from {resume} (optimizer step {done_steps}, "
                  f"{'bf16 autocast' if autocast else 'fp32'} as it was trained)")

    t0 = time.perf_counter()
    budget.start(accelerator)
    raw = accelerator.unwrap_model(head)
    micro = 0
    bar = tqdm(total=hc.epochs * per_epoch, initial=micro_done, desc="train head", unit="batch",
               dynamic_ncols=True, disable=not accelerator.is_main_process)
    for epoch in range(hc.epochs):
        if budget.over:
            break
        epoch_batches = batches(lengths, train_idx, hc.batch_size, cfg.seed, epoch)
        mine = epoch_batches[accelerator.process_index::accelerator.num_processes][:per_epoch]
        for idx in mine:
            micro += 1
            if micro <= micro_done:
                continue  # replayed by the checkpoint: the stream is deterministic, so skip it
            with accelerator.accumulate(head):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    res = run_ttt(head, raw, batcher, batcher(idx), dc.horizons, dc.loss_decay)
                accelerator.backward(res.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, hc.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    budget.tick()  # before the schedule reads it: every rank agrees on the time
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                done_steps += 1
                acc = [c / n if n else 0.0 for c, n in zip(res.step_correct, res.step_count)]
                bar.set_postfix(loss=f"{res.loss.item():.3f}", acc0=f"{acc[0]:.2f}", epoch=epoch)
                if tracker is not None and accelerator.is_main_process:
                    tracker.log({"head/step": done_steps, "head/loss": res.loss.item(),
                                 "head/lr": scheduler.get_last_lr()[0],
                                 **{f"head/acc_{k}": a for k, a in enumerate(acc)},
                                 **{f"head/loss_{k}": v for k, v in enumerate(res.step_loss)}})
                if hc.save_every and done_steps % hc.save_every == 0:
                    save_checkpoint(accelerator, ckpt_root / f"step_{done_steps}", micro, budget.seconds, autocast)
            bar.update(1)
            if budget.over:
                bar.write(f"[head] time budget of {hc.max_minutes} min reached after {done_steps} of "
                          f"{total_steps} steps (train.head.max_minutes); the schedule decayed with it")
                break
    bar.close()
    train_seconds = time.perf_counter() - t0
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return {"process": accelerator.process_index}
    metrics = evaluate(raw, batcher, lengths, held_idx, cfg)
    metrics.update({"train_seconds": round(train_seconds, 1), "optimizer_steps": done_steps, "epochs": hc.epochs,
                    "planned_steps": total_steps, "stopped_by": "max_minutes" if budget.over else None,
                    "resumed_from_step": resumed_from,
                    "train_rows": len(train_idx), "heldout_rows": len(held_idx), "draft_vocab_size": size,
                    "rows_too_long": len(rows) - len(fits),
                    "horizons": dc.horizons, "feature_cache": hc.feature_cache, "processes": accelerator.num_processes,
                    "precision": {**precision.summary(), "autocast": autocast}})
    with atomic.atomic_path(out) as tmp:
        save_head(raw, tmp)
        atomic.write_json(tmp / "train_metrics.json", metrics)
        write_manifest(tmp, fp, stage="head", target=location)
    shutil.rmtree(ckpt_root, ignore_errors=True)
    accelerator.wait_for_everyone()
    print(f"[head] saved {out}: held-out loss {metrics['heldout_loss']:.3f}, acc per horizon "
          f"{[round(a, 3) for a in metrics['heldout_acc']]}, {metrics['train_seconds']} s")
    if tracker is not None:
        tracker.summary({"head/heldout_loss": metrics["heldout_loss"],
                         **{f"head/heldout_acc_{k}": a for k, a in enumerate(metrics["heldout_acc"])}})
        # the exported folder as vLLM/SGLang load it, versioned by W&B beside the run that trained it
        tracker.artifact(out, f"head-{cfg.run_name}", "model")
    return {**metrics, "cached": False}


def save_checkpoint(accelerator: Any, folder: Path, micro_steps: int, seconds: float = 0.0, autocast: bool = False,
                    keep: int = 2) -> None:
    """Save a resumable state; ``progress.json`` marks it complete once every rank has written, and
    says in which precision it was trained (a resumed run keeps it)."""
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        atomic.write_json(folder / "progress.json", {"micro_steps": micro_steps, "seconds": round(seconds, 3),
                                                     "autocast": autocast})
        older = sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]
        for path in older:
            shutil.rmtree(path, ignore_errors=True)
