"""Shared fixtures: the real config tree composed by Hydra, shrunk to a temp folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose(overrides: list[str] | None = None, config_name: str = "config"):
    """The DictConfig `train/run.py` (or, with config_name="infer", `infer/run.py`) would get."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from schemafill.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


@pytest.fixture
def make_cfg(tmp_path):
    """Build a PipelineConfig writing under tmp_path, with tracking off unless asked."""
    from schemafill.config import to_dataclass

    def _make(*overrides: str):
        base = [f"paths.artifacts={tmp_path / 'artifacts'}", "logger=none"]
        return to_dataclass(compose(base + list(overrides)))

    return _make


@pytest.fixture(scope="session")
def builtin_artifacts(tmp_path_factory):
    """A session artifacts folder holding the requests and the converted built-in base model.

    Made once per run: parallel workers (``pytest -n``) share one conversion under a lock, and
    each gets a folder of its own to write stages into, the base model linked into it (stages
    read it and write beside it)."""
    from filelock import FileLock

    from schemafill.config import to_dataclass
    from train.run import run
    from train.target import convert_gguf, locate_gguf

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "builtin-shared"
    shared.mkdir(exist_ok=True)
    made = shared / "artifacts"
    with FileLock(str(shared / ".lock")):
        cfg = to_dataclass(compose([f"paths.artifacts={made}", "logger=none", "stages=[requests]"]))
        run(cfg)  # a no-op once made (the stage is resumable)
        base_model = convert_gguf(locate_gguf(cfg.model.source, cfg.model.gguf_file),
                                  made / "targets" / f"{cfg.model.name}-base")
    root = tmp_path_factory.mktemp("builtin") / "artifacts"
    shutil.copytree(made, root, ignore=shutil.ignore_patterns("targets"))
    (root / "targets").mkdir()
    (root / "targets" / base_model.name).symlink_to(base_model, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def smol_tokenizer(builtin_artifacts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_artifacts / "targets" / "smollm2-135m-base")


@pytest.fixture(scope="session")
def marker_tokenizer(builtin_artifacts):
    """The built-in tokenizer with ``[TOOL_CALLS]`` as one special token (id 49152), as Mistral
    v0.3's vocabulary holds it: a plain decode drops it, the mistral format must not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_artifacts / "targets" / "smollm2-135m-base")
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def wandb_record(run_dir: Path, *needles: bytes, timeout: float = 60.0) -> bytes:
    """An offline W&B run's protobuf log once it holds every one of ``needles`` (or after
    ``timeout`` seconds): wandb-core may still be flushing it when ``finish()`` returns on a
    loaded host (CI once read only its 7-byte header)."""
    import time

    log = next(run_dir.glob("run-*.wandb"))
    deadline, record = time.monotonic() + timeout, b""
    while time.monotonic() < deadline:
        record = log.read_bytes()
        if all(n in record for n in needles):
            break
        time.sleep(0.2)
    return record


def tiny_llama(vocab_size: int = 49152, seed: int = 0, **overrides):
    """A random-init Llama small enough for unit tests, with the built-in target's vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=True)
    config = LlamaConfig(**{**settings, **overrides})
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_target(builtin_artifacts, smol_tokenizer, tmp_path_factory):
    """A random two-layer Llama with the built-in target's tokenizer, saved like a hub model."""
    folder = tmp_path_factory.mktemp("tiny_target")
    model = tiny_llama(seed=3, num_hidden_layers=4)
    model.generation_config.eos_token_id = smol_tokenizer.eos_token_id
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def accelerate_launch(processes: int, script: str, *args: str, timeout: int = 1200) -> None:
    """Run ``script`` under ``accelerate launch`` with ``processes`` CPU processes; fail with its stderr."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------- decoding through the one loop
def decode_ar(target, tokenizer, prompt, max_new_tokens, eos, sampler=None, constraint=None, fmt=None):
    """Greedy (or sampled) AR: the round loop with a policy that proposes nothing."""
    from infer.rounds import loop
    from infer.rounds.decoding import DecodeOptions, Runtime
    from schemafill.contract.response_format import JSON

    rt = Runtime(target, tokenizer, frozenset(eos), max_new_tokens, fmt or JSON)
    return loop.decode(rt, prompt, DecodeOptions(sampler, constraint), loop.Drafting())


class Drafts:
    """A test drafter with ``draft(tokens, new_aux) -> (tokens, parents)`` as a loop proposer."""

    drafted = False

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def start(self, s) -> None:
        self.drafter.start(s.layout.positions)

    def propose(self, s):
        from infer.rounds.candidates import Candidates

        return Candidates.tree(*self.drafter.draft(s.tokens, s.new_aux), "draft")

    def finish(self, s) -> dict:
        return {}


def decode_tree(target, tokenizer, prompt, max_new_tokens, eos, drafter, scratch=64, sampler=None, constraint=None,
                budget=None, fmt=None):
    """Every round, what ``drafter`` proposes (a loop proposer, or a test drafter), priced by ``budget``."""
    from infer.rounds import loop
    from infer.rounds.decoding import DecodeOptions, Runtime
    from schemafill.contract.response_format import JSON

    rt = Runtime(target, tokenizer, frozenset(eos), max_new_tokens, fmt or JSON)
    proposer = drafter if hasattr(drafter, "propose") else Drafts(drafter)
    return loop.decode(rt, prompt, DecodeOptions(sampler, constraint), loop.Proposing(proposer, scratch, budget))
