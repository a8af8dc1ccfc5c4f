"""The pipeline entry point: stage `requests` end to end, caching, atomic writes, bad
input, unimplemented stages, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schemafill import atomic
from schemafill.contract.toolcall import InvalidRequest
from tests.conftest import ROOT, wandb_record
from train.run import run


def test_requests_stage_writes_eval_and_training_sets(make_cfg):
    cfg = make_cfg("stages=[requests]")
    result = run(cfg)
    out = Path(cfg.paths.artifacts) / "requests"
    bfcl450 = [json.loads(line) for line in (out / "bfcl450.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(bfcl450) == 450 and len(train) >= 2000
    assert not {r["id"] for r in bfcl450} & {r["id"] for r in train}
    stats = json.loads((out / "stats.json").read_text())
    assert stats["eval"] == {"bfcl450": 450, "bfcl450_structured": 450} and stats["train"] == len(train)
    assert result["stages"]["requests"]["cached"] is False and "requests" in result["seconds"]
    summary = json.loads((Path(cfg.paths.artifacts) / "run_summary" / "smollm2-135m.json").read_text())
    assert list(summary["stages"]) == ["requests"] and summary["last_run"]["stages"] == ["requests"]
    assert summary["stages"]["requests"]["seconds"] == result["seconds"]["requests"]
    host = summary["stages"]["requests"]["host"]
    assert host["cpu_capability"] and host["cpu_count"] >= 1
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == stats["rejected"] and rejected[0]["reason"] == "no tools"

    # unchanged inputs: a no-op; changed data config: rebuilt
    assert run(cfg)["stages"]["requests"]["cached"] is True
    assert run(make_cfg("stages=[requests]", "data.seed=1"))["stages"]["requests"]["cached"] is False


def test_users_own_requests_join_the_pool_and_bad_lines_are_reported(make_cfg, tmp_path):
    good = {"id": "mine_1", "messages": [{"role": "user", "content": "Book a table for two at Nopa tonight"}],
            "tools": [{"type": "function", "function": {"name": "book", "parameters": {
                "type": "object", "properties": {"place": {"type": "string"}}}}}]}
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(good) + "\n{oops\n" + json.dumps({**good, "id": "mine_2", "tools": "book"}) + "\n")
    cfg = make_cfg("stages=[requests]", f"data.extra_requests=[{path}]")
    run(cfg)
    out = Path(cfg.paths.artifacts) / "requests"
    assert "mine_1" in (out / "train.jsonl").read_text()
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    mine = [(r["line"], r["id"]) for r in rejected if r["source"] == str(path)]
    assert mine == [(2, None), (3, "mine_2")]
    with pytest.raises(InvalidRequest, match="strict mode"):
        run(make_cfg("stages=[requests]", f"data.extra_requests=[{path}]", "data.strict=true"))


def test_a_stage_without_its_inputs_says_which_stage_to_run(make_cfg):
    cfg = make_cfg("stages=[eval]")
    with pytest.raises(FileNotFoundError, match="run the `target` stage first"):
        run(cfg)


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "stats.json"
    atomic.write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic.atomic_path(target) as tmp:
            tmp.write_text('{"v": 2, "half')
            raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temp left behind


def test_atomic_folder_replacement_keeps_new_content_only(tmp_path):
    target = tmp_path / "dataset"
    with atomic.atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "a.txt").write_text("old")
    with atomic.atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "b.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]


def test_command_line(tmp_path):
    art = tmp_path / "art"
    ok = subprocess.run([sys.executable, "train/run.py", "stages=[requests]", f"paths.artifacts={art}", "logger=none"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "bfcl450=450" in ok.stdout and (art / "requests" / "bfcl450.jsonl").exists()
    bad = subprocess.run([sys.executable, "train/run.py", "model.dtyp=bf16", "logger=none"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "Key 'dtyp' not in 'ModelConfig'" in bad.stderr
    standalone = subprocess.run([sys.executable, "data_gen/run.py", "stages=[requests]", f"paths.artifacts={art}",
                                 "logger=none"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert standalone.returncode == 0 and "up to date" in standalone.stdout
    helped = subprocess.run([sys.executable, "train/run.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert "model: hermes3-8b, mistral-7b, qwen2.5, qwen2.5-7b, qwen3, qwen3-8b, smollm2-135m" in helped.stdout
    # the design card's own command: the paper's target by its family name (offline: a clear hint)
    paper = subprocess.run([sys.executable, "train/run.py", "model=qwen2.5", "stages=[target]", "logger=none",
                            f"paths.artifacts={art}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "Could not find" not in paper.stderr and "Qwen/Qwen2.5-7B-Instruct" in paper.stderr
    assert "model.source=/path/to/Qwen2.5-7B-Instruct" in paper.stderr


def test_pipeline_run_is_tracked_with_wandb_offline(make_cfg, tmp_path):
    cfg = make_cfg("stages=[requests]", "logger=wandb", "logger.mode=offline", f"logger.dir={tmp_path}")
    run(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # offline runs keep config, history and summary in the run's protobuf log until `wandb sync`
    record = wandb_record(runs[0], b"smollm2-135m", b"git_sha", b"requests/train")
    assert b"smollm2-135m" in record and b"git_sha" in record and b"requests/train" in record, record[:200]


def test_the_run_summary_keeps_every_stage_of_the_whole_run():
    """A later run of one stage replaces that stage's entry only; a failed stage is named and
    keeps its last good entry."""
    from train.run import merge_summary

    host = {"cpu_capability": "AVX512"}
    whole = {"stages": {s: {"cached": False, "precision": {"bf16": s == "target"}, "valid_json_rate": 0.95}
                        for s in ("requests", "target")},
             "seconds": {"requests": 1.5, "target": 200.0}}
    summary = merge_summary(None, "m", "", "requests", whole, host, "t1")
    summary = merge_summary(summary, "m", "", "target", whole, host, "t1")
    assert list(summary["stages"]) == ["requests", "target"] and summary["total_seconds"] == 201.5
    assert summary["stages"]["target"]["precision"] == {"bf16": True} and "precision" in summary["stages"]["requests"]
    assert summary["stages"]["target"]["figures"] == {"valid_json_rate": 0.95}  # the target's quality rides along
    assert "figures" not in summary["stages"]["requests"]
    alone = {"stages": {"requests": {"cached": False}}, "seconds": {"requests": 0.7}}
    later = merge_summary(summary, "m", "", "requests", alone, host, "t2")
    assert later["stages"]["target"] == summary["stages"]["target"]  # the whole run's target survives
    assert later["stages"]["requests"] == {"seconds": 0.7, "cached": False, "finished": "t2", "host": host}
    assert later["last_run"] == {"stages": ["requests"], "failed": None, "finished": "t2"}
    # a cached rerun keeps the measured entry (its outputs are that run's), marked reused
    reused = merge_summary(later, "m", "", "target", {"stages": {"target": {"cached": True}}, "seconds": {"target": 0.1}},
                           host, "t2b")
    assert reused["stages"]["target"] == {**summary["stages"]["target"], "reused": "t2b"}
    assert reused["total_seconds"] == 200.7
    failed = merge_summary(later, "m", "", "target", {"stages": {}, "seconds": {"target": 3.0}}, host, "t3")
    assert failed["last_run"]["failed"] == "target" and failed["stages"]["target"] == summary["stages"]["target"]
    # a summary of the older layout (stage names only) is read as no entries, not an error
    assert list(merge_summary({"stages": ["requests"]}, "m", "", "requests", alone, host, "t4")["stages"]) == ["requests"]
