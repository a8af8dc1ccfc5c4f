"""Sweeps: `train/run.py --multirun` over two tiny random targets runs continuations, head and
eval for each and ends with the cross-target summary (slow); a sweep through submitit's local
executor (the SLURM launcher's path) runs each job in its own process, in one W&B group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_llama, wandb_record


@pytest.mark.slow
def test_multirun_sweep_writes_each_report_and_the_summary(tmp_path, builtin_artifacts, smol_tokenizer):
    models = tmp_path / "models"
    for seed, name in enumerate(("micro-a", "micro-b")):
        model = tiny_llama(seed=seed, num_hidden_layers=4)
        model.generation_config.eos_token_id = smol_tokenizer.eos_token_id
        model.save_pretrained(models / name)
        smol_tokenizer.save_pretrained(models / name)
    art = tmp_path / "artifacts"
    (art / "requests").mkdir(parents=True)
    for f in ("train.jsonl", "bfcl450.jsonl"):
        (art / "requests" / f).write_text((builtin_artifacts / "requests" / f).read_text())
    cmd = [sys.executable, "train/run.py", "--multirun", "model.name=micro-a,micro-b",
           f"model.source={models}/${{model.name}}", "model.finetune=false", "model.aux_layer_ids=[1,2,3]",
           "stages=[continuations,head,eval]", f"paths.artifacts={art}", "logger=none",
           f"hydra.sweep.dir={tmp_path / 'multirun'}", "decode.max_new_tokens=12",
           "data.continuations.max_requests=16", "data.continuations.max_prompt_tokens=700",
           "drafter.draft_vocab_size=512", "train.head.epochs=1", "train.head.batch_size=4",
           "train.head.max_seq_len=512", "train.head.heldout_fraction=0.2",
           "eval.limit=2", "eval.methods=[ar,eagle3,schemafill]", "eval.ablations=false"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("micro-a", "micro-b"):
        metrics = json.loads((art / "eval" / name / "metrics.json").read_text())
        assert metrics["bfcl450"]["schemafill"]["ar_agreement"] == 1.0
        assert (art / "eval" / name / "report.md").is_file()
    summary = (art / "eval" / "summary.md").read_text()
    assert "| micro-a | bfcl450 | ar |" in summary and "| micro-b | bfcl450 | schemafill |" in summary


def test_a_sweep_runs_each_job_through_submitit_and_groups_their_wandb_runs(tmp_path):
    """`--multirun` through hydra-submitit-launcher's local executor (the SLURM launcher's code
    path, minus sbatch): one process per job, each job's stage done, one W&B group per sweep."""
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "train/run.py", "--multirun", "hydra/launcher=submitit_local", "stages=[requests]",
         "tag=a,b", "logger=wandb", "logger.mode=offline", f"logger.dir={tmp_path}",
         f"paths.artifacts={tmp_path / 'art'}", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in done.stdout + done.stderr
    for tag in ("a", "b"):  # each job ran in its own process and wrote its own summary
        summary = json.loads((tmp_path / "art" / "run_summary" / f"smollm2-135m-{tag}.json").read_text())
        assert list(summary["stages"]) == ["requests"] and summary["tag"] == tag
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 2  # submitit ran both, not Hydra's basic launcher
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    # the group is field 6 of wandb's RunRecord (wire tag 0x32, then its length): the sweep folder
    group = str(sweep).encode()
    assert len(group) < 128  # a one-byte length
    expected = bytes([0x32, len(group)]) + group
    for run_dir in runs:
        record = wandb_record(run_dir, expected)
        assert expected in record, record[:300]


def test_the_slurm_launcher_config_composes_with_its_overrides():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from schemafill.config import register_configs
    from tests.conftest import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="config", return_hydra_config=True,
                            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "model=qwen2.5"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 1440)
