"""The SchemaFill pipeline for one target: ``python train/run.py model=<target>``.

Runs the stages named in ``stages`` (default: every implemented stage) in pipeline order:
requests → target → continuations → head → eval. Each stage reads only the artifacts of
the stages before it, is cached by fingerprint and writes atomically, so any stage can be
rerun or resumed alone (``stages=[head]``). ``--multirun model=a,b`` sweeps targets.
``run(cfg) -> dict`` is what tests and sweeps call.
"""

from __future__ import annotations

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
from schemafill.device import host_summary
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
    """Per-stage seconds of this run (a cached stage takes ~0 s) and the host they were measured on."""
    done = [s for s in results["seconds"] if s in results["stages"]]
    atomic.write_json(summary_path(cfg), {
        "model": cfg.model.name, "tag": cfg.tag, "stages": done, "failed": None if stage in done else stage,
        "seconds": results["seconds"], "total_seconds": round(sum(results["seconds"].values()), 2),
        "cached": {s: bool(results["stages"][s].get("cached")) for s in done if isinstance(results["stages"][s], dict)},
        "host": host_summary(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


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
