"""Stage `eval`: every method on the evaluation sets, side by side, and the paper's tables.

    python train/run.py model=<m> stages=[eval]        # as a pipeline stage

For each evaluation set in ``artifacts/requests`` (``bfcl450``; ``glaive650`` when Glaive was
configured, else skipped with a message) it decodes ``eval.methods`` — plus SchemaFill's
ablation stages A–C on bfcl450 — with ``launch.run``, ``eval.repeats`` times,
and writes ``artifacts/eval/<model>/``:

* ``metrics.json`` — ``{dataset: {method: {accept_length, tps, tps_std, speedup, ar_agreement,
  tokens, target_calls, seconds, requests, nodes_per_verify, kv_rows, ...}}}``;
* ``by_calls.json`` — the same per number of calls in AR's response (1, 2, 3, 4+);
* ``sampled.json`` — ``eval.sampled_methods`` (the lossless ones) at ``eval.temperature`` (paper App. C.5);
* ``constrained.json`` — ``eval.constrained_methods`` free and with ``decode.constrain=schema``;
* ``report.md`` with Tables 1–7 and ``plots/*.png``; the same tables, plots and the report
  go to W&B.

Each finished launch is kept in a work folder, so an interrupted stage resumes at the next
launch; the stage is cached by the fingerprint of the target, head, requests and settings.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from infer import decoders
from infer.eval import report
from infer.eval.launch import run as infer_run
from infer.eval.metrics import pooled
from schemafill import atomic
from schemafill.config import InferConfig, LoggerConfig, PipelineConfig, to_dict
from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.toolcall import parse_response
from schemafill.fingerprint import file_digest, fingerprint, load_if_fresh, read_manifest, write_manifest
from schemafill.runtime.loading import decode_choice, target_location

OUTPUTS = ["metrics.json", "by_calls.json", "report.md"]
GLAIVE_HINT = "Glaive is not configured: set data.glaive to the corpus (hub id or local copy) and rerun `requests`"


def eval_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.paths.artifacts) / "eval" / cfg.run_name


def methods_for(cfg: PipelineConfig, dataset: str) -> list[str]:
    methods = list(cfg.eval.methods)
    if cfg.eval.ablations and dataset == "bfcl450":
        # stage A is EAGLE-3 under SchemaFill's policy: token for token and call for call the
        # same as `eagle3` at the same budget (tested), so Table 2 reuses eagle3's row
        stages = (["A"] if "eagle3" not in methods else []) + ["B", "C"]
        if cfg.decode.ablation != "D" or "schemafill" not in methods:
            stages.append("D")
        methods += [m for m in map(decoders.ablation_method, stages) if m not in methods]
    return methods


def call_group(text: str, fmt: ResponseFormat = JSON) -> str:
    calls = parse_response(text.strip(), fmt)
    if not calls:
        return "none"
    return str(len(calls)) if len(calls) < 4 else "4+"


def summarize(launches: list[dict[str, list[dict]]]) -> dict[str, dict]:
    """Pooled metrics per method over the first launch; TPS mean ± sample std over all."""
    first = launches[0]
    reference = {r["id"]: r["output_ids"] for r in first["ar"]} if "ar" in first else None
    out = {m: pooled(rows, reference) for m, rows in first.items()}
    for m in out:
        tps = [pooled(launch[m], None)["tps"] for launch in launches]
        out[m]["tps"] = statistics.fmean(tps)
        out[m]["tps_std"] = statistics.stdev(tps) if len(tps) > 1 else None
        out[m]["launches"] = len(tps)
    ar_tps = out.get("ar", {}).get("tps")
    for m in out.values():
        m["speedup"] = m["tps"] / ar_tps if ar_tps else None
    return out


def by_calls(rows: dict[str, list[dict]], fmt: ResponseFormat = JSON) -> dict[str, dict[str, dict]]:
    """Pooled metrics per group of requests with the same number of calls in AR's response."""
    if "ar" not in rows:
        return {}
    group = {r["id"]: call_group(r["text"], fmt) for r in rows["ar"]}
    reference = {r["id"]: r["output_ids"] for r in rows["ar"]}
    out: dict[str, dict[str, dict]] = {}
    for g in sorted(set(group.values()), key=lambda g: (g == "none", g)):
        out[g] = {m: pooled([r for r in rs if group[r["id"]] == g], reference) for m, rs in rows.items()}
    return out


def kv_bytes_per_row(location: str, dtype_bytes: int, revision: str | None) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(location, revision=revision)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def build_eval(cfg: PipelineConfig, tracker: Any = None) -> dict:
    import torch

    from schemafill.runtime.device import resolve_device

    ec = cfg.eval
    art = Path(cfg.paths.artifacts)
    out = eval_dir(cfg)
    location = target_location(cfg.model, cfg.paths.artifacts)
    head = art / "heads" / cfg.run_name
    files = {d: art / "requests" / f"{d}.jsonl" for d in ec.datasets}
    present = {d: f for d, f in files.items() if f.is_file()}
    for d in files.keys() - present.keys():
        print(f"[eval] {d}: {files[d]} not found — skipped" + (f" ({GLAIVE_HINT})" if d.startswith("glaive") else ""))
    if not present:
        raise FileNotFoundError(f"no evaluation set found in {art / 'requests'}: run the `requests` stage first")
    for d in present:  # a misspelt method fails here, not after the first launch
        decoders.check(methods_for(cfg, d), 0.0)
    if not (head / "config.json").is_file():
        raise FileNotFoundError(f"{head} missing: run stages=[continuations,head] first")
    fp = fingerprint({"eval": to_dict(ec), "decode": to_dict(cfg.decode), "model": to_dict(cfg.model),
                      "target": (read_manifest(location) or {}).get("fingerprint", location),
                      "head": (read_manifest(head) or {}).get("fingerprint"), "seed": cfg.seed,
                      "requests": {d: file_digest(f) for d, f in present.items()}, "format": 1})
    if (metrics := load_if_fresh("eval", out, fp, OUTPUTS, "metrics.json")) is not None:
        write_summary(out.parent)
        return {"metrics": metrics, "report": str(out / "report.md"), "cached": True}

    work = out.parent / f".{out.name}.work" / fp
    metrics: dict[str, dict] = {}
    calls: dict[str, dict] = {}
    def launch(dataset: str, name: str, methods: list[str], decode: Any) -> dict[str, list[dict]]:
        saved = work / dataset / f"{name}.json"
        if saved.is_file():  # finished before an interruption
            return json.loads(saved.read_text())
        print(f"[eval] {dataset}: {name}")
        icfg = InferConfig(requests=str(present[dataset]), methods=methods, out=str(work / dataset / f"infer_{name}"),
                           head=str(head), limit=ec.limit, sample="spread", warmup=ec.warmup, seed=cfg.seed,
                           model=cfg.model, decode=decode, logger=LoggerConfig(backend="none"), paths=cfg.paths)
        result = infer_run(icfg)
        # how each method chose its nodes (cost curve, per-source acceptance) rides beside the rows
        atomic.write_json(work / dataset / f"{name}.selection.json",
                          {m: v["selection"] for m, v in result["metrics"].items() if v.get("selection")})
        atomic.write_json(saved, result["rows"])
        return result["rows"]

    sampled: dict[str, dict] = {}
    compared: dict[str, dict] = {}  # Table 7: {dataset: {"none"|"schema": metrics}}
    mode = cfg.decode.constrain
    other = "none" if mode == "schema" else "schema"
    for dataset in present:
        launches = [launch(dataset, f"launch_{rep}", methods_for(cfg, dataset), cfg.decode)
                    for rep in range(ec.repeats)]
        metrics[dataset] = summarize(launches)
        selection = work / dataset / "launch_0.selection.json"
        for m, chosen in (json.loads(selection.read_text()) if selection.is_file() else {}).items():
            if m in metrics[dataset]:
                metrics[dataset][m]["selection"] = chosen
        calls[dataset] = by_calls(launches[0], cfg.model.fmt)
        if ec.temperature > 0:  # paper App. C.5: the lossless methods, sampling
            methods = [m for m in ec.sampled_methods if m in ec.methods and m != "parallel_fill"]
            hot = dataclasses.replace(cfg.decode, temperature=ec.temperature)
            sampled[dataset] = summarize([launch(dataset, f"temperature_{ec.temperature:g}", methods, hot)])
        methods = [m for m in ec.constrained_methods if m in ec.methods and m != "parallel_fill"]
        if methods:  # the same requests with the response grammar on (or off, when the main launch had it)
            flipped = dataclasses.replace(cfg.decode, constrain=other)
            compared[dataset] = {mode: {m: v for m, v in metrics[dataset].items() if m in methods},
                                 other: summarize([launch(dataset, f"constrain_{other}", methods, flipped)])}

    device = resolve_device()
    dtype, precision = decode_choice(cfg.model, location, device, verifies=True)
    per_row = kv_bytes_per_row(location, torch.empty(0, dtype=dtype).element_size(), cfg.model.revision)
    with atomic.atomic_path(out) as tmp:
        atomic.write_json(tmp / "metrics.json", metrics)
        atomic.write_json(tmp / "by_calls.json", calls)
        atomic.write_json(tmp / "sampled.json", {"temperature": ec.temperature, "metrics": sampled})
        atomic.write_json(tmp / "constrained.json", compared)
        head_metrics = json.loads((head / "train_metrics.json").read_text()) \
            if (head / "train_metrics.json").is_file() else None
        tables, plots = write_report(tmp, cfg.run_name, metrics, calls, per_row, str(dtype).replace("torch.", ""),
                                     sampled, ec.temperature, compared, head_metrics)
        write_manifest(tmp, fp, stage="eval", target=location, head=str(head))
    shutil.rmtree(work.parent, ignore_errors=True)
    summary = write_summary(out.parent)
    print(f"[eval] report: {out / 'report.md'}; every target: {summary}")
    if tracker is not None:
        for name, (columns, rows) in tables.items():
            tracker.table(f"eval/{name}", columns, rows)
        for name in plots:
            tracker.image(f"eval/{name}", out / "plots" / f"{name}.png")
        tracker.summary({f"eval/{d}/{m}/{k}": v for d, ms in metrics.items() for m, vals in ms.items()
                         for k, v in vals.items() if k in ("accept_length", "tps", "speedup", "ar_agreement")
                         and v is not None})
        tracker.artifact(out, f"eval-{cfg.run_name}", "eval")  # the head went to W&B from its own stage
    return {"metrics": metrics, "report": str(out / "report.md"), "precision": precision, "cached": False}


def write_report(folder: Path, model: str, metrics: dict, calls: dict, bytes_per_row: int,
                 dtype: str, sampled: dict | None = None, temperature: float = 0.0,
                 compared: dict | None = None, head: dict | None = None) -> tuple[dict, list[str]]:
    """report.md and plots/*.png in ``folder``; returns the tables and plot names. ``head``: the
    draft head's ``train_metrics.json``."""
    tables = {"table1_end_to_end": report.table1(metrics)}
    lines = [f"# SchemaFill evaluation — `{model}`", "",
             "AL = committed tokens per target call (prefill included); E2E TPS = committed tokens per second, "
             "timed from prompt rendering to stop; speedup = TPS / AR's TPS in the same launch; "
             "AR agreement = share of requests whose tokens equal AR's.", "",
             "## Table 1 — end to end", "", report.markdown(*tables["table1_end_to_end"]), ""]
    if head:
        tables["head"] = report.head_table(head)
        lines += ["## The draft head", "", "Held-out top-1 agreement with the target's own next token, per "
                  "horizon (step k drafts k + 1 tokens ahead), on continuations the head never trained on.", "",
                  report.markdown(*tables["head"]), ""]
    learners = [m for m in ("toolspec", "suffix") if any(m in ms for ms in metrics.values())]
    if learners:
        lines += [f"{', '.join(learners)} learn from earlier outputs: each launch starts them empty, and they learn "
                  "only from responses decoded before in the same launch (never from the references)."]
        if "toolspec" in learners:
            lines += ["ToolSpec follows its authors' code (hemingkx/ToolSpec: token recycling into their 80-node "
                      "tree, retrieval of the 10 most similar earlier outputs, their schema FSM) except where our "
                      "response format and runtime force a change; the README lists each difference "
                      "(\"ToolSpec, and where ours differs\")."]
        lines += [""]
    plots = []
    main = "bfcl450" if "bfcl450" in metrics else next(iter(metrics))
    m = metrics[main]
    lines += report.cost_section(m)
    if any(k.startswith("schemafill_") for k in m):
        tables["table2_ablation"] = report.table2(m)
        lines += [f"## Table 2 — ablation on {main}", "", report.markdown(*tables["table2_ablation"]), ""]
    if calls.get(main):
        tables["table3_by_calls"] = report.table3(calls[main])
        lines += [f"## Table 3 — by the number of calls in AR's response ({main})", "",
                  report.markdown(*tables["table3_by_calls"]), ""]
    tables["table4_kv"] = report.table4(m, bytes_per_row)
    lines += [f"## Table 4 — per-request target KV ({main}, {dtype})", "",
              "Peak rows holding live KV (prompt, committed response, the tree under verification, SIDE "
              "branches); reserved spare capacity and the drafter's KV are excluded.", "",
              report.markdown(*tables["table4_kv"]), ""]
    sf = m.get("schemafill") or m.get("schemafill_D")
    if sf and sf.get("time_breakdown"):
        tables["table5_time"] = report.table5(sf)
        lines += [f"## Table 5 — SchemaFill time breakdown ({main})", "", report.markdown(*tables["table5_time"]), ""]

    if sampled:
        tables["table6_sampled"] = report.table6(sampled)
        lines += [f"## Table 6 — sampling at temperature {temperature:g}", "",
                  "Exact speculative sampling: the target's choice at each verified node is a fresh draw, and "
                  "every draft (head, copies, suffix trees, recycling, packed values) depends only on committed "
                  "tokens, so the output follows the target's distribution; AR agreement does not apply to samples.",
                  "",
                  report.markdown(*tables["table6_sampled"]), ""]
    if compared:
        tables["table7_constrained"] = report.table7(compared)
        lines += ["## Table 7 — free vs schema-constrained decoding", "",
                  "`decode.constrain=schema`: the target chooses only tokens the request's response grammar allows "
                  "(xgrammar), so every response is a valid call of the request's tools. Valid calls = outputs that "
                  "parse and validate against that schema (checked with `jsonschema`). Forced tokens, where the "
                  "grammar allows one token only, are committed without a target decision: *AL* counts them, "
                  "*AL w/o forced* does not. Speedup is over AR in the same mode; *TPS vs free* is each "
                  "constrained method against its own free run.", "",
                  report.markdown(*tables["table7_constrained"]), ""]
    lines += ["## Plots", ""]
    shown = {k: v for k, v in m.items() if v["accept_length"] is not None}
    report.bar_plot({k: v["accept_length"] for k, v in shown.items()}, "accept length", f"AL per method ({main})",
                    folder / "plots" / "al_per_method.png")
    report.bar_plot({k: v["speedup"] for k, v in m.items() if v.get("speedup") is not None}, "speedup over AR",
                    f"Speedup per method ({main})", folder / "plots" / "speedup_per_method.png")
    plots += ["al_per_method", "speedup_per_method"]
    groups = {g: ms for g, ms in (calls.get(main) or {}).items() if g != "none"}
    if groups:
        series = {meth: {g: ms[meth]["accept_length"] for g, ms in groups.items()
                         if ms[meth]["accept_length"] is not None}
                  for meth in ("eagle3", "schemafill") if all(meth in ms for ms in groups.values())}
        if series:
            report.line_plot(series, "calls in AR's response", "accept length", f"AL by call count ({main})",
                             folder / "plots" / "al_by_calls.png")
            plots.append("al_by_calls")
    lines += [f"![{p}](plots/{p}.png)" for p in plots] + [""]
    atomic.write_text(folder / "report.md", "\n".join(lines))
    return tables, plots


def write_summary(root: Path) -> Path:
    """``summary.md``: Table 1's main columns for every target evaluated under ``root`` (what a
    ``--multirun model=a,b`` sweep ends with; paper App. D)."""
    columns = ["Target", "Dataset", "Method", "AL", "E2E TPS", "Speedup", "AR agreement (%)", "Requests"]
    rows = []
    for metrics_file in sorted(root.glob("*/metrics.json")):
        for dataset, methods in json.loads(metrics_file.read_text()).items():
            _, table = report.table1({dataset: methods})
            rows += [[metrics_file.parent.name] + r[:6] + [r[7]] for r in table]
    text = "\n".join(["# SchemaFill across targets", "", "One row per target, dataset and method, from each "
                      "target's `metrics.json` (reports: `<target>/report.md`).", "",
                      report.markdown(columns, rows), ""])
    atomic.write_text(root / "summary.md", text)
    return root / "summary.md"
