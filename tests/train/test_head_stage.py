"""Stage `head` end to end on a tiny random target: training, held-out metrics, export,
resume after a kill (equal to an uninterrupted run), and distributed runs (slow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from data_gen.continuations import build_continuations
from schemafill.config import to_dataclass
from schemafill.runtime.drafter import load_head
from schemafill.runtime.precision import Precision
from schemafill.tracking import NullTracker
from tests.conftest import ROOT, accelerate_launch, compose
from train.eagle3 import Budget, build_head, heads_dir


def args_for(artifacts, tiny, *extra):
    return [f"paths.artifacts={artifacts}", "logger=none", "model.finetune=false", f"model.source={tiny}",
            "model.name=tiny", "model.aux_layer_ids=[1,2,3]", "decode.max_new_tokens=16",
            "data.continuations.max_requests=24", "data.continuations.shard_size=8",
            "data.continuations.max_prompt_tokens=700", "drafter.draft_vocab_size=512",
            "train.head.epochs=2", "train.head.batch_size=4", "train.head.max_seq_len=512",
            "train.head.heldout_fraction=0.2", "train.head.lr=1e-3",
            "model.dtype=float32",  # whatever the host probe prefers: features are compared with an fp32 rerun
            *extra]


@pytest.fixture(scope="module")
def tiny_continuations(builtin_artifacts, tiny_target, tmp_path_factory):
    art = tmp_path_factory.mktemp("head_stage") / "artifacts"
    (art / "requests").mkdir(parents=True)
    for name in ("train.jsonl", "bfcl450.jsonl"):
        (art / "requests" / name).write_text((builtin_artifacts / "requests" / name).read_text())
    build_continuations(to_dataclass(compose(args_for(art, tiny_target))))
    return art


def clone(art, dst):
    shutil.copytree(art / "requests", dst / "requests")
    shutil.copytree(art / "continuations", dst / "continuations")
    return dst


@pytest.mark.parametrize("cache", [True, False])
def test_head_trains_exports_and_reports(tiny_continuations, tiny_target, tmp_path, cache):
    art = clone(tiny_continuations, tmp_path / "a")
    cfg = to_dataclass(compose(args_for(art, tiny_target, f"train.head.feature_cache={str(cache).lower()}")))
    tracker = NullTracker()
    metrics = build_head(cfg, tracker)
    out = heads_dir(cfg)
    assert tracker.artifacts == [(str(out), "head-tiny", "model")]  # the exported head, to W&B
    saved = json.loads((out / "train_metrics.json").read_text())
    assert len(saved["heldout_acc"]) == 2 and all(0 <= a <= 1 for a in saved["heldout_acc"])
    assert saved["heldout_loss"] > 0 and saved["heldout_rows"] > 0 and saved["optimizer_steps"] > 0
    assert metrics["cached"] is False and build_head(cfg)["cached"] is True
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's key, HF numbering
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang's, one lower
    assert config["draft_vocab_size"] == 512 and config["vocab_size"] == 49152
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    head = load_head(out, torch.nn.Embedding(49152, 64), torch.ones(8))
    assert head.t2d.sum() == 512


def test_features_captured_by_continuations_feed_the_head(tiny_continuations, tiny_target, tmp_path, monkeypatch):
    """Continuations that keep their features give the head the same features a rerun of
    the target over the rows would (where the loss reads them), and the head stage uses
    them instead of running the target again."""
    import datasets
    import numpy as np
    from transformers import AutoModelForCausalLM

    from schemafill.runtime.feature_cache import FeatureCache
    from schemafill.runtime.loading import from_hf_model

    art = clone(tiny_continuations, tmp_path / "captured")  # built with the defaults: features kept
    cfg = to_dataclass(compose(args_for(art, tiny_target, "train.head.feature_cache=true")))
    assert cfg.data.continuations.features
    cont = art / "continuations" / "tiny"
    rows = datasets.load_from_disk(str(cont)).to_list()
    captured = FeatureCache(cont / "features")
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    built = FeatureCache.build(tmp_path / "built", from_hf_model(model, [1, 2, 3]), [r["input_ids"] for r in rows],
                               [r["prompt_len"] - 1 for r in rows])
    assert captured.offsets == built.offsets
    for i, r in enumerate(rows):
        o, e, s = captured.offsets[i], captured.offsets[i + 1], captured.offsets[i] + r["prompt_len"] - 1
        a = lambda m, lo, hi: np.asarray(m[lo:hi], dtype=np.float32)  # noqa: E731
        assert np.allclose(a(captured.aux, o, e - 1), a(built.aux, o, e - 1), atol=2e-3)  # the last token: never fed
        assert np.allclose(a(captured.final, s, e - 1), a(built.final, s, e - 1), atol=2e-3)
        assert captured.argmax[s:e - 1].tolist() == built.argmax[s:e - 1].tolist()

    def no_rerun(*_, **__):
        raise AssertionError("the head stage ran the target over rows whose features it had")

    monkeypatch.setattr(FeatureCache, "build", no_rerun)
    metrics = build_head(cfg)
    assert metrics["optimizer_steps"] > 0 and metrics["heldout_loss"] > 0


def test_resume_after_kill_matches_an_uninterrupted_run(tiny_continuations, tiny_target, tmp_path, monkeypatch):
    """Killed after a checkpoint, resumed, the head equals an uninterrupted run's — in the precision
    its first steps took, even where the resuming launch's probe chooses the other one (another
    thread count, a busy host)."""
    import train.eagle3 as eagle3

    extra = ("train.head.save_every=2", "train.head.epochs=3", "train.head.feature_cache=true")
    art = clone(tiny_continuations, tmp_path / "killed")
    args = args_for(art, tiny_target, *extra)
    proc = subprocess.Popen([sys.executable, "train/run.py", "stages=[head]", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    ckpts = art / "heads" / ".checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not list(ckpts.glob("*/step_*/progress.json")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = sorted(ckpts.glob("*/step_*/progress.json"))
    assert saved, "no checkpoint was written before the kill"
    assert not (art / "heads" / "tiny" / "config.json").exists()
    trained_in = json.loads(saved[-1].read_text())["autocast"]  # what the killed launch's probe chose

    def probe_says(bf16: bool) -> None:
        monkeypatch.setattr(eagle3, "train_precision", lambda *a, **k: Precision(bf16, "the test's probe"))

    probe_says(not trained_in)
    resumed = build_head(to_dataclass(compose(args)))
    assert resumed["resumed_from_step"] >= 2 and resumed["precision"]["autocast"] == trained_in

    probe_says(trained_in)
    fresh = clone(tiny_continuations, tmp_path / "fresh")
    whole = build_head(to_dataclass(compose(args_for(fresh, tiny_target, *extra))))
    assert whole["resumed_from_step"] == 0 and whole["optimizer_steps"] == resumed["optimizer_steps"]
    a = load_file(str(art / "heads" / "tiny" / "model.safetensors"))
    b = load_file(str(fresh / "heads" / "tiny" / "model.safetensors"))
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2])
def test_two_process_training_matches_one_process(tiny_continuations, tiny_target, tmp_path, processes):
    losses = {}
    for n, batch in ((1, 4), (processes, 2)):  # same global batch: 4 rows per optimizer step
        art = clone(tiny_continuations, tmp_path / f"p{n}")
        args = args_for(art, tiny_target, f"train.head.batch_size={batch}", "train.head.feature_cache=false")
        accelerate_launch(n, "train/run.py", "stages=[head]", *args)
        losses[n] = json.loads((art / "heads" / "tiny" / "train_metrics.json").read_text())["heldout_loss"]
    assert abs(losses[1] - losses[processes]) / losses[1] < 0.05, losses


@pytest.mark.slow
def test_deepspeed_zero2_smoke(tiny_continuations, tiny_target, tmp_path):
    art = clone(tiny_continuations, tmp_path / "ds")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "2",
           "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
           "--gradient_accumulation_steps", "1", "train/run.py", "stages=[head]",
           *args_for(art, tiny_target, "train.head.epochs=1", "train.head.grad_accum=1")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (art / "heads" / "tiny" / "model.safetensors").exists()


def test_the_schedule_follows_steps_or_minutes_whichever_is_further():
    budget = Budget(steps=100, seconds=60.0)
    budget.seconds = 15.0
    assert budget.progress(10) == 0.25 and budget.progress(50) == 0.5 and not budget.over
    budget.seconds = 60.0
    assert budget.progress(10) == 1.0 and budget.over
    free = Budget(steps=100, seconds=0.0)
    free.seconds = 1e9
    assert free.progress(10) == 0.1 and not free.over


def test_a_time_budget_ends_training_early_with_a_head_all_the_same(tiny_continuations, tiny_target, tmp_path):
    art = clone(tiny_continuations, tmp_path / "budget")
    cfg = to_dataclass(compose(args_for(art, tiny_target, "train.head.max_minutes=1e-6")))
    metrics = build_head(cfg)
    assert metrics["stopped_by"] == "max_minutes" and metrics["optimizer_steps"] == 1 < metrics["planned_steps"]
    assert (heads_dir(cfg) / "model.safetensors").is_file() and len(metrics["heldout_acc"]) == 2
