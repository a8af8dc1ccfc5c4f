"""A micro sweep: `train/run.py --multirun` over two tiny random targets runs continuations,
head and eval for each and ends with the cross-target summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_llama


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
