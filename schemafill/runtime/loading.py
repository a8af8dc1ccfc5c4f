"""Where a target's weights come from, and loading them with a clear error when they are
not there, onto the backend that will run its calls. The built-in target lives under
``artifacts/targets/<name>/`` once the `target` stage has made it; every other target is a
hub id or a local folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from schemafill.config import ModelConfig
from schemafill.runtime import backends
from schemafill.runtime.model import Target, read_checkpoint, sharing


def target_dir(model: ModelConfig, artifacts: str | Path) -> Path:
    """Where the fine-tuned target lives: one folder per response format it was taught (the
    json one keeps the plain name), so a hermes fine-tune never replaces the json target."""
    name = model.name if model.response_format == "json" else f"{model.name}-{model.response_format}"
    return Path(artifacts) / "targets" / name


def target_location(model: ModelConfig, artifacts: str | Path) -> str:
    """The folder or hub id to load the (possibly fine-tuned) target from."""
    if model.finetune:
        path = target_dir(model, artifacts)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"no fine-tuned target at {path}: run the `target` stage first "
                f"(python train/run.py model={model.name} stages=[target])"
            )
        return str(path)
    return model.source


def _offline_hint(source: str, err: Exception) -> OSError:
    return OSError(
        f"could not load {source!r} ({type(err).__name__}: {err}). If it is a hub id, this machine "
        f"cannot reach the hub: download it where you can (`huggingface-cli download {source}`) and "
        f"pass the folder with model.source=/path/to/{Path(source).name}"
    )


def load_tokenizer(source: str, revision: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as e:
        raise _offline_hint(source, e) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: str, dtype: torch.dtype, device: torch.device, revision: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype)
    except (OSError, ValueError) as e:
        raise _offline_hint(source, e) from e
    return model.to(device).eval()


def load_config(source: str, revision: str | None = None) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as e:
        raise _offline_hint(source, e) from e


def local_folder(source: str, revision: str | None = None) -> Path:
    """A local folder holding ``source``'s config and safetensors (hub ids: the local cache,
    or a download where the hub is reachable)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; all mean "not here"
        raise _offline_hint(source, e) from e


def generation_eos(source: str, tokenizer: Any, revision: str | None = None) -> frozenset[int]:
    """Every id that ends a turn for this model: the tokenizer's and its generation config's."""
    from transformers import GenerationConfig

    from schemafill.contract.stopping import eos_token_ids

    try:
        generation_config = GenerationConfig.from_pretrained(source, revision=revision)
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        generation_config = None
    return eos_token_ids(tokenizer, generation_config)


def load_target(folder: str | Path, dtype: torch.dtype, device: torch.device, aux_layer_ids: list[int] | None = None,
                backend: str = "auto", decodes: bool = True) -> Target:
    """A runtime target from a local Hugging Face folder (config.json + safetensors), its calls
    run by ``backend`` (``runtime.backends.attach``; ``decodes``: it will run the decode loop).
    On a GPU its weights are its own: Q/K/V and gate/up become one product each (fewer launches)."""
    target = read_checkpoint(folder, dtype, device, aux_layer_ids)
    if target.device.type != "cpu":
        target.fuse()
    return backends.attach(target, backend, decodes)


def from_hf_model(model: Any, aux_layer_ids: list[int] | None = None, backend: str = "auto") -> Target:
    """A runtime target sharing the parameters of an in-memory ``transformers`` model (on a CPU,
    the fused Q/K/V and gate/up products hold copies: build it after training, not before). Such
    a target generates batches (training data, quality checks): ``auto`` measures no decode-loop
    backend for it."""
    return backends.attach(sharing(model, aux_layer_ids), backend, decodes=False)


def load_runtime(source: str, dtype: torch.dtype, device: torch.device, aux_layer_ids: list[int] | None = None,
                 revision: str | None = None, backend: str = "auto", decodes: bool = True) -> Target:
    """The target on the inference runtime (``load_target``). On a CPU, the process's allocator
    then keeps freed memory for the runtime's large activations (``runtime/allocator.py``)."""
    from schemafill.runtime.allocator import retain_freed_memory

    if device.type == "cpu":
        print(f"[runtime] allocator: {retain_freed_memory()}")
    target = load_target(local_folder(source, revision), dtype, device, aux_layer_ids, backend, decodes)
    print(f"[runtime] backend: {target.runs_on().name} ({target.runs_on().summary().get('why', '')})")
    return target


def decode_choice(model: ModelConfig, location: str, device: torch.device, verifies: bool) -> tuple[torch.dtype, dict]:
    """The dtype ``model`` runs forward in on ``device``, and why (a stage records it): ``model.dtype``,
    where ``auto`` on a CPU is measured at the target's own shapes (``schemafill/precision.py``).

    Work that ``verifies`` drafts takes bf16 under ``auto`` on a CPU only where the runtime's
    forwards are batch-invariant there (``backends.batch_invariant.possible``): a verification computes n
    rows where AR computes one, and unless a row's numbers are the same bits either way, bf16
    rounds the two differently often enough that speculative tokens stop equalling AR's
    (docs/builtin-target.md, "Precision"). Elsewhere it keeps fp32. Generating training data
    verifies nothing, so it takes the probe's choice; ``model.dtype=bfloat16`` forces bf16 everywhere."""
    from schemafill.runtime.device import decode_precision, resolve_dtype

    if model.dtype == "auto" and device.type == "cpu":
        probed = decode_precision(device, load_config(location, model.revision))
        if verifies and probed.bf16:
            if backends.batch_invariant.possible(torch.bfloat16):
                return probed.dtype, {**probed.summary(), "why": f"{probed.why}; batch-invariant forwards keep "
                                                                 f"verification equal to AR"}
            kept = dataclasses.replace(probed, bf16=False, why=f"fp32 for lossless verification (no batch-invariant "
                                                                f"forward on this host), though the {probed.why}")
            return kept.dtype, kept.summary()
        return probed.dtype, probed.summary()
    dtype = resolve_dtype(model.dtype, device)
    return dtype, {"bf16": dtype == torch.bfloat16, "why": f"model.dtype={model.dtype} on {device.type}"}


def load_launch_target(model: ModelConfig, artifacts: str | Path, device: torch.device
                       ) -> tuple[Target, Any, frozenset[int]]:
    """What a decoding launch (``infer/run.py``, ``infer/serve.py``) runs on: the target on the
    inference runtime (on the backend ``model.backend`` names), its tokenizer and its stop tokens."""
    location = target_location(model, artifacts)
    tokenizer = load_tokenizer(location, model.revision)
    eos = generation_eos(location, tokenizer, model.revision)
    dtype, why = decode_choice(model, location, device, verifies=True)
    print(f"[infer] precision: {str(dtype).removeprefix('torch.')} ({why['why']})")
    target = load_runtime(location, dtype, device, model.aux_layer_ids, model.revision, model.backend)
    return target, tokenizer, eos
