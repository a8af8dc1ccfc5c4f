"""Stage `eval` end to end on a tiny random target and head: metrics per dataset and method,
the report with its tables and plots, W&B-style logging, caching, and resume after a crash."""

from __future__ import annotations

import json
import shutil

import pytest

from schemafill.config import to_dataclass
from schemafill.tracking import NullTracker
from tests.conftest import compose
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)


def eval_cfg(tmp_path, tiny_target, tiny_head, builtin_artifacts, *extra):
    art = tmp_path / "artifacts"
    (art / "requests").mkdir(parents=True, exist_ok=True)
    shutil.copy(builtin_artifacts / "requests" / "bfcl450.jsonl", art / "requests" / "bfcl450.jsonl")
    if not (art / "heads" / "tiny").exists():
        shutil.copytree(tiny_head, art / "heads" / "tiny")
    return to_dataclass(compose([
        f"paths.artifacts={art}", "model.name=tiny", f"model.source={tiny_target}", "model.finetune=false",
        "model.aux_layer_ids=[1,2,3]", "decode.max_new_tokens=24", "eval.limit=3", "eval.repeats=2",
        "logger=none", "stages=[eval]", *extra]))


def test_eval_stage_writes_metrics_report_and_plots(tmp_path, tiny_target, tiny_head, builtin_artifacts, capsys):
    from infer.eval.stage import build_eval

    cfg = eval_cfg(tmp_path, tiny_target, tiny_head, builtin_artifacts, "eval.temperature=1.0", "eval.ablations=true",
                   "eval.constrained_methods=[ar,eagle3,schemafill]")
    tracker = NullTracker()
    result = build_eval(cfg, tracker)
    assert "glaive650" in capsys.readouterr().out  # absent: named and skipped
    out = tmp_path / "artifacts" / "eval" / "tiny"
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["bfcl450"] and result["metrics"] == metrics
    m = metrics["bfcl450"]
    # stage A is eagle3 (tested in test_schemafill), so it is not decoded twice
    assert list(m) == ["ar", "eagle3", "toolspec", "ngram", "suffix", "parallel_fill", "schemafill", "schemafill_B",
                       "schemafill_C"]
    for method in ("eagle3", "toolspec", "ngram", "suffix", "schemafill", "schemafill_B", "schemafill_C"):
        assert m[method]["ar_agreement"] == 1.0 and m[method]["requests"] == 3
    assert m["ar"]["speedup"] == 1.0 and m["ar"]["launches"] == 2 and m["ar"]["tps_std"] is not None
    assert m["parallel_fill"]["accept_length"] is None
    by_calls = json.loads((out / "by_calls.json").read_text())
    assert sum(g["ar"]["requests"] for g in by_calls["bfcl450"].values()) == 3
    text = (out / "report.md").read_text()
    sampled = json.loads((out / "sampled.json").read_text())
    assert sampled["temperature"] == 1.0 and list(sampled["metrics"]["bfcl450"]) == cfg.eval.sampled_methods
    assert sampled["metrics"]["bfcl450"]["ar"]["speedup"] == 1.0
    for title in ("Table 1", "Table 2", "Table 4", "Table 5", "Table 6", "Table 7"):
        assert title in text
    assert "toolspec, suffix learn from earlier outputs" in text  # the report says what they learn from
    assert "except where our response format and runtime force a change" in text  # and where ToolSpec differs
    assert "Node selection: cost-aware" in text and "c(1) = " in text  # the measured curve, in the report
    assert m["schemafill"]["selection"]["cost_model"]["sizes"][0] == 1
    compared = json.loads((out / "constrained.json").read_text())["bfcl450"]  # Table 7: free vs schema
    assert list(compared["schema"]) == list(compared["none"]) == cfg.eval.constrained_methods
    for method, v in compared["schema"].items():
        assert v["ar_agreement"] == 1.0, method  # each equals *constrained* AR
        assert v["forced"] == compared["schema"]["ar"]["forced"] > 0 and v["decided_al"] < v["accept_length"]
    assert compared["none"]["schemafill"] == m["schemafill"]  # the free side is the main launch
    constrained_rows = text.split("## Table 7")[1].split("##")[0]
    assert constrained_rows.count("| bfcl450 | schemafill |") == 2  # free and schema
    ablation = text.split("## Table 2")[1].split("##")[0]
    assert [line.split("|")[1].strip() for line in ablation.splitlines() if line.startswith("| ")][1:] == \
        ["A", "B", "C", "D"]  # A from eagle3's row, D from schemafill's
    for plot in ("al_per_method", "speedup_per_method"):
        assert f"](plots/{plot}.png)" in text
        assert (out / "plots" / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"eval/table1_end_to_end", "eval/table2_ablation", "eval/table4_kv"} <= set(tracker.tables)
    assert "eval/al_per_method" in tracker.images and any(kind == "eval" for _, _, kind in tracker.artifacts)
    assert not (out.parent / ".tiny.work").exists()  # launches are cleaned up once reported
    summary = (out.parent / "summary.md").read_text()
    assert "| tiny | bfcl450 | schemafill |" in summary and "schemafill_B" not in summary
    assert build_eval(cfg, None)["cached"] is True


def test_eval_resumes_after_a_crash(tmp_path, tiny_target, tiny_head, builtin_artifacts, monkeypatch):
    import infer.eval.stage as stage

    cfg = eval_cfg(tmp_path, tiny_target, tiny_head, builtin_artifacts, "eval.methods=[ar,eagle3]",
                   "eval.ablations=false", "eval.temperature=0", "eval.constrained_methods=[]")
    real, calls = stage.infer_run, []

    def crash_on_second(icfg):
        calls.append(icfg.out)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(icfg)

    monkeypatch.setattr(stage, "infer_run", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        stage.build_eval(cfg, None)
    calls.clear()
    monkeypatch.setattr(stage, "infer_run", lambda icfg: (calls.append(icfg.out), real(icfg))[1])
    stage.build_eval(cfg, None)
    assert len(calls) == 1 and calls[0].endswith("infer_launch_1")  # the first launch was kept
