"""`infer/run.py` end to end on a tiny random target with a random exported head: metrics,
outputs, lossless agreement, and bad input named and skipped."""

from __future__ import annotations

import json

import pytest
import torch

from schemafill.config import InferConfig, to_dataclass
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.drafter import Eagle3Head, HeadConfig, save_head
from schemafill.runtime.loading import load_target
from schemafill.runtime.model import rope_tables
from tests.conftest import compose


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory):
    """A random head for the tiny target, exported like stage `head` exports one."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), aux_layer_ids=[1, 2, 3], backend="eager")
    torch.manual_seed(0)
    c = HeadConfig.from_target(target.hf_config, draft_vocab_size=4096, aux_layer_ids=[1, 2, 3])
    head = Eagle3Head(c, target.model.embed_tokens, *rope_tables(target.hf_config))
    head.set_vocab(torch.arange(4096))
    folder = tmp_path_factory.mktemp("head")
    save_head(head, folder)
    return folder


def infer_cfg(tmp_path, tiny_target, tiny_head, requests, *extra) -> InferConfig:
    return to_dataclass(compose([
        f"requests={requests}", f"out={tmp_path / 'out'}", f"head={tiny_head}", f"model.source={tiny_target}",
        "model.finetune=false", "model.aux_layer_ids=[1,2,3]", "decode.max_new_tokens=24", "warmup=1",
        f"paths.artifacts={tmp_path / 'artifacts'}", *extra], config_name="infer"), InferConfig)


def test_cli_decodes_losslessly_and_names_bad_input(tmp_path, tiny_target, tiny_head, builtin_artifacts,
                                                    smol_tokenizer):
    from infer.run import run

    lines = (builtin_artifacts / "requests" / "bfcl450.jsonl").read_text().splitlines()[:5]
    lines = [json.dumps(json.loads(x) | {"category": ["simple", "parallel"][i % 2]}) for i, x in enumerate(lines)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    lengths = [len(prompt_ids(ToolRequest.from_dict(json.loads(x)), "plain", smol_tokenizer)) for x in lines]
    cfg = infer_cfg(tmp_path, tiny_target, tiny_head, requests, "methods=[ar,eagle3,eagle3_wide,schemafill,toolspec,parallel_fill]",
                    f"model.max_context={max(lengths) - 1 + 24}",  # the longest prompt no longer fits
                    "decode=paper")  # the fixed budgets, whose node counts are asserted below
    result = run(cfg)
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["ar", "eagle3", "eagle3_wide", "schemafill", "toolspec", "parallel_fill"]
    assert metrics["parallel_fill"]["accept_length"] is None  # no verification: AL does not apply
    skipped = [json.loads(x) for x in (out / "skipped.jsonl").read_text().splitlines()]
    assert any(s["line"] == 3 and "not JSON" in s["reason"] for s in skipped)
    assert any("exceed the context" in s["reason"] for s in skipped)
    decoded = metrics["ar"]["requests"]
    assert 0 < decoded < 5 and decoded + len(skipped) == 6
    for m in ("eagle3", "eagle3_wide", "schemafill", "toolspec"):
        assert metrics[m]["ar_agreement"] == 1.0  # lossless on every request
        assert metrics[m]["tokens"] == metrics["ar"]["tokens"]
    assert metrics["ar"]["accept_length"] == 1.0 and metrics["ar"]["nodes_per_verify"] == 0
    assert metrics["eagle3"]["nodes_per_verify"] <= 8 < metrics["eagle3_wide"]["nodes_per_verify"] <= 60
    rows = [json.loads(x) for x in (out / "outputs" / "eagle3.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"id", "sample", "repeat", "text", "prompt_ids", "output_ids", "target_calls", "seconds",
                            "stop", "forced", "valid", "call_rows", "call_ms", "head_forwards", "head_ms"}
    assert set(metrics["schemafill"]["time_breakdown"]) == {"forecast", "drafting", "verification", "other",
                                                            "initialisation"}
    for row in result["rows"]["ar"]:  # AR's KV holds the prompt and every response token but the last
        assert row["kv_rows"] == len(row["prompt_ids"]) + len(row["output_ids"]) - 1
    assert metrics["ar"]["kv_rows"] <= metrics["eagle3"]["kv_rows"]
    assert metrics["schemafill"]["init_nodes"] > 0  # forecast candidates verified with the prompt
    assert result["metrics"] == metrics and set(result["rows"]) == set(metrics)
    category = {json.loads(x)["id"]: json.loads(x)["category"] for x in lines}
    for m in ("ar", "eagle3", "schemafill"):  # each category on its own, against AR's on the same requests
        split = metrics[m]["by_category"]
        assert set(split) == {"simple", "parallel"} and sum(c["requests"] for c in split.values()) == decoded
        assert sum(c["seconds"] for c in split.values()) == pytest.approx(metrics[m]["seconds"], abs=1e-2)
        assert all(c["ar_agreement"] == 1.0 for c in split.values())
        for c, v in split.items():
            ar_seconds = sum(r["seconds"] for r in result["rows"]["ar"] if category[r["id"]] == c)
            assert v["x_ar"] == pytest.approx(ar_seconds / v["seconds"], rel=1e-2)
    assert all(v["x_ar"] == 1.0 for v in metrics["ar"]["by_category"].values()), metrics["ar"]["by_category"]


def test_a_launch_at_a_concurrency_decodes_the_same_tokens_over_its_wall_time(tmp_path, tiny_target, tiny_head,
                                                                               builtin_artifacts):
    """``concurrency=3``: every method's requests decoded three at a time in one batch give the
    same tokens as one at a time; TPS is over the wall time, shorter than the summed latencies."""
    from infer.run import run

    lines = (builtin_artifacts / "requests" / "bfcl450.jsonl").read_text().splitlines()[::60][:5]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    methods = "methods=[ar,eagle3,suffix,schemafill]"
    alone = run(infer_cfg(tmp_path / "alone", tiny_target, tiny_head, requests, methods))["metrics"]
    together = run(infer_cfg(tmp_path / "together", tiny_target, tiny_head, requests, methods, "concurrency=3"))
    for m, v in together["metrics"].items():
        assert v["ar_agreement"] == 1.0 and v["tokens"] == alone[m]["tokens"], m
        assert alone[m]["wall_seconds"] is None and 0 < v["wall_seconds"] < v["seconds"], m
        # TPS is over the wall time, which the record rounds to the millisecond (a tiny target's
        # launch can take a few tens of them, so a relative tolerance would not do)
        assert abs(v["tokens"] / v["tps"] - v["wall_seconds"]) <= 5e-4 + 1e-9, m
    with pytest.raises(ValueError, match="concurrency=1"):
        run(infer_cfg(tmp_path / "pf", tiny_target, tiny_head, requests, "methods=[ar,parallel_fill]", "concurrency=2"))


def test_unknown_method_and_bad_settings_are_named_before_any_model_loads(tmp_path, tiny_target, tiny_head):
    from infer.run import run

    missing = tmp_path / "r.jsonl"  # never read: each error comes first
    with pytest.raises(ValueError, match="eagle9"):
        run(infer_cfg(tmp_path, tiny_target, tiny_head, missing, "methods=[ar,eagle9]"))
    with pytest.raises(ValueError, match="list ar before it"):
        run(infer_cfg(tmp_path, tiny_target, tiny_head, missing, "methods=[parallel_fill,ar]"))
    with pytest.raises(ValueError, match="greedy diagnostic"):
        run(infer_cfg(tmp_path, tiny_target, tiny_head, missing, "methods=[ar,parallel_fill]", "decode.temperature=1"))
    with pytest.raises(Exception, match="decode.constrain must be one of"):
        infer_cfg(tmp_path, tiny_target, tiny_head, missing, "decode.constrain=maybe")


def test_missing_head_says_how_to_make_one(tmp_path, tiny_target, builtin_artifacts):
    from infer.run import run

    requests = builtin_artifacts / "requests" / "bfcl450.jsonl"
    cfg = infer_cfg(tmp_path, tiny_target, tmp_path / "nowhere", requests, "limit=1")
    with pytest.raises(FileNotFoundError, match="stages=\\[continuations,head\\]"):
        run(cfg)


def test_sampling_cli_is_seeded_and_draws_samples(tmp_path, tiny_target, tiny_head, builtin_artifacts):
    from infer.run import run

    lines = (builtin_artifacts / "requests" / "bfcl450.jsonl").read_text().splitlines()[:2]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    outs = []
    for folder in ("a", "b"):
        # the fixed budget: cost-aware selection follows host timings, so its drafts (and with them
        # which draw lands where) may differ between two launches; the fixed tree does not
        cfg = infer_cfg(tmp_path / folder, tiny_target, tiny_head, requests, "methods=[ar,eagle3,schemafill]",
                        "decode=paper", "decode.temperature=1.0", "samples=3", "decode.max_new_tokens=12")
        result = run(cfg)
        assert all(m["ar_agreement"] is None for m in result["metrics"].values())  # samples agree in law only
        outs.append({m: [(r["id"], r["sample"], r["output_ids"]) for r in rows] for m, rows in result["rows"].items()})
    assert outs[0] == outs[1]  # the same decode.seed, the same samples
    ar = outs[0]["ar"]
    assert len(ar) == 6 and len({tuple(ids) for _, _, ids in ar}) > 2  # distinct draws per request
    with pytest.raises(Exception, match="temperature > 0"):
        infer_cfg(tmp_path, tiny_target, tiny_head, requests, "samples=2")


def test_cost_aware_launch_is_lossless_interleaved_and_reports_its_cost_curve(tmp_path, tiny_target, tiny_head,
                                                                              builtin_artifacts):
    from infer.run import run

    lines = (builtin_artifacts / "requests" / "bfcl450.jsonl").read_text().splitlines()[:3]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    cfg = infer_cfg(tmp_path, tiny_target, tiny_head, requests, "methods=[ar,eagle3,ngram,suffix,schemafill]",
                    "repeats=2", f"decode.cost_cache={tmp_path / 'cost'}")
    assert cfg.decode.select == "cost" and cfg.interleave
    result = run(cfg)
    metrics = result["metrics"]
    for m in ("eagle3", "ngram", "suffix", "schemafill"):
        assert metrics[m]["ar_agreement"] == 1.0 and metrics[m]["tokens"] == metrics["ar"]["tokens"]
        sel = metrics[m]["selection"]
        assert sel["select"] == "cost" and sel["cost_model"]["sizes"][0] == 1
        assert list(sel["cost_model"]["ms"]) == sorted(sel["cost_model"]["ms"])  # monotone by construction
        assert sel["cost_model"]["key"] == metrics["schemafill"]["selection"]["cost_model"]["key"]
        if m != "eagle3":  # a random head's drafts may all be judged not worth a row on a fast host
            assert sum(s["reached"] for s in sel["sources"].values()) > 0  # the estimates learnt from the launch
    assert metrics["ar"]["requests"] == 6  # two passes over three requests, pooled
    assert sorted(r["repeat"] for r in result["rows"]["schemafill"]) == [0, 0, 0, 1, 1, 1]
    assert len(list((tmp_path / "cost").glob("*.json"))) == 1  # measured once, shared by every method
    # every call's shape is recorded: the prefill (the prompt, for SchemaFill with its first
    # candidates) first, then one per verification; the head's forwards where a head drafts
    # (SchemaFill's in every request, from its first round; EAGLE-3's may skip every request
    # of a launch that measured its random head not worth its time in the warm-up)
    for m, rows in result["rows"].items():
        for r in rows:
            assert len(r["call_rows"]) == len(r["call_ms"]) == r["target_calls"]
            assert r["call_rows"][0] >= len(r["prompt_ids"]) and min(r["call_rows"]) >= 1
            if m != "eagle3":
                assert (r["head_forwards"] > 0) == (m == "schemafill")

    # ... which the device projection replays (here on the CPU at the tiny shape)
    from benchmarks.gpu_project import run as project

    report = project(str(tmp_path / "out"), shape="tiny", repeats=1)
    projected = report["methods"]
    assert set(projected) == {"ar", "eagle3", "ngram", "suffix", "schemafill"} and projected["ar"]["x_ar"] == 1.0
    for m, v in projected.items():
        assert v["tokens"] == metrics[m]["tokens"] and v["target_s"] > 0 and v["tps"] > 0
        assert (v["head_s"] > 0) == (sum(r["head_forwards"] for r in result["rows"][m]) > 0)
    assert projected["schemafill"]["head_s"] > 0
    assert report["prefill_ms"] and all(int(n) & (int(n) - 1) == 0 for n in report["verify_ms"])  # powers of two
    # host time per call measured on a device (gpu_check --lossless) replaces the CPU's where given
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"bfloat16": {"ar": {"host_ms_per_call": 1.5}}}))
    on_device = project(str(tmp_path / "out"), shape="tiny", repeats=1, host=str(host))["methods"]
    calls = sum(len(r["call_rows"]) for r in result["rows"]["ar"])
    assert on_device["ar"]["host_s"] == round(1.5 * calls / 1e3, 3) and on_device["ar"]["host_measured_on"] == "device"
    assert on_device["schemafill"]["host_measured_on"] == "cpu"


def test_help_names_the_methods_and_the_node_selection():
    import subprocess
    import sys

    from tests.conftest import ROOT

    helped = subprocess.run([sys.executable, "infer/run.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "suffix " in helped.stdout and "Node selection: decode=cost (default)" in helped.stdout
