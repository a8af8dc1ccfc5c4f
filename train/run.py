"""The SchemaFill pipeline for one target: ``python train/run.py model=<target>``.

Runs the stages named in ``stages`` (default: every implemented stage) in pipeline order:
requests → target → continuations → head → eval. Each stage reads only the artifacts of
the stages before it, is cached by fingerprint and writes atomically, so any stage can be
rerun or resumed alone (``stages=[head]``). ``--multirun model=a,b`` sweeps targets.
``run(cfg) -> dict`` is what tests and sweeps call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from data_gen.run import build_continuations, build_requests
from infer.eval.stage import build_eval
from schemafill import atomic
from schemafill.config import STAGES, PipelineConfig, register_configs, to_dataclass, to_dict
from schemafill.runtime import host
from schemafill.tracking import NullTracker, start_run
from train.eagle3 import build_head
from train.target import QualityGateError, build_target

# Stage name → runner(cfg, tracker) -> dict
RUNNERS = {"requests": build_requests, "target": build_target, "continuations": build_continuations,
           "head": build_head, "eval": build_eval}


def run(cfg: PipelineConfig) -> dict:
    stages = [s for s in STAGES if s in cfg.stages]  # pipeline order, whatever order was given
    # under `accelerate launch`, one W&B run: the main process tracks, the others keep quiet.
    # Read the launcher's RANK rather than creating Accelerate state here: each stage sets up
    # its own (DeepSpeed's must come from the Accelerator, not an earlier PartialState).
    main = int(os.environ.get("RANK", "0")) == 0
    tracker = start_run(cfg.logger, to_dict(cfg), name=cfg.model.name, job_type="pipeline") if main else NullTracker()
    results: dict = {"model": cfg.model.name, "stages": {}, "seconds": {}}
    try:
        for stage in stages:
            t0 = time.perf_counter()
            print(f"=== stage {stage} ({cfg.model.name}) ===")
            try:
                results["stages"][stage] = RUNNERS[stage](cfg, tracker)
            finally:
                results["seconds"][stage] = round(time.perf_counter() - t0, 2)
                if main:
                    write_summary(cfg, results, stage)
            tracker.summary({f"{stage}/seconds": results["seconds"][stage]})
    finally:
        tracker.finish()
    print("stage times (s): " + ", ".join(f"{k}={v}" for k, v in results["seconds"].items()))
    print(f"run summary: {summary_path(cfg).resolve()}")
    print(f"artifacts: {Path(cfg.paths.artifacts).resolve()}")
    if "eval" in results["stages"]:
        print(f"report: {Path(results['stages']['eval']['report']).resolve()}")
    return results


def summary_path(cfg: PipelineConfig) -> Path:
    return Path(cfg.paths.artifacts) / "run_summary" / f"{cfg.run_name}.json"


def write_summary(cfg: PipelineConfig, results: dict, stage: str) -> None:
    """The run summary after ``stage``: this stage's entry replaces its last one, the others stay
    (a later run of one stage keeps what the whole run measured)."""
    path = summary_path(cfg)
    try:
        previous = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, OSError):
        previous = None  # a damaged summary is started afresh, not a reason to stop
    atomic.write_json(path, merge_summary(previous, cfg.model.name, cfg.tag, stage, results, host.summary(),
                                          time.strftime("%Y-%m-%dT%H:%M:%S%z")))


FIGURES = {"target": ("valid_json_rate", "tool_name_accuracy", "mean_calls"), "continuations": ("rows", "tokens_per_s"),
           "head": ("heldout_acc", "train_rows", "epochs")}


def figures(stage: str, result: dict) -> dict:
    """What a stage's summary entry says it achieved: the target's quality, the head's held-out
    accuracy, each method's accept length and speedup in the main evaluation set."""
    if stage == "eval":
        metrics = result.get("metrics") or {}
        main = metrics.get("bfcl450") or next(iter(metrics.values()), {})
        return {m: {"accept_length": v.get("accept_length"), "speedup": v.get("speedup")} for m, v in main.items()}
    return {k: result[k] for k in FIGURES.get(stage, ()) if k in result}


def merge_summary(previous: dict | None, model: str, tag: str, stage: str, results: dict, host: dict,
                  finished: str) -> dict:
    """Each stage's latest seconds, whether it was cached, when it finished, the host and the
    precision it ran with; and what this run did (its stages, the one that failed, if any). A
    stage reused from the cache keeps the entry of the run that computed it, marked ``reused``."""
    kept = (previous or {}).get("stages")
    stages = dict(kept) if isinstance(kept, dict) else {}  # an older summary listed stage names only
    result = results["stages"].get(stage)
    if isinstance(result, dict) and result.get("cached") and stages.get(stage, {}).get("cached") is False:
        stages[stage] = {**stages[stage], "reused": finished}  # its outputs are the measured run's: keep its figures
    elif isinstance(result, dict):
        entry = {"seconds": results["seconds"][stage], "cached": bool(result.get("cached")), "finished": finished,
                 "host": host}
        if result.get("precision") is not None:
            entry["precision"] = result["precision"]
        if figures(stage, result):
            entry["figures"] = figures(stage, result)
        stages[stage] = entry
    run = [s for s in results["seconds"] if s in results["stages"]]
    ordered = {s: stages[s] for s in STAGES if s in stages}
    return {"model": model, "tag": tag, "stages": ordered,
            "total_seconds": round(sum(e["seconds"] for e in ordered.values()), 2),
            "last_run": {"stages": run, "failed": None if stage in run else stage, "finished": finished}}


register_configs()


def sweep_group() -> str | None:
    """The W&B group of this job: its sweep's folder under ``--multirun`` (whichever launcher ran
    it, so every target of one sweep lands in one group), None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    config = to_dataclass(cfg)
    if config.logger.group is None:
        config.logger.group = sweep_group()
    try:
        run(config)
    except QualityGateError as e:  # a verdict, not a crash: the message says what to turn
        print(f"[target] {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    sys.exit(main())
