"""Data stages. ``python data_gen/run.py stages=[requests,continuations] [data=...]`` runs
them alone (``accelerate launch --num_processes N data_gen/run.py stages=[continuations]``
spreads generation over N processes); ``train/run.py`` runs them as part of the pipeline.

Stage ``requests``: BFCL v3 (every category), Glaive when ``data.glaive`` is set, and the
user's own JSONL files → ``artifacts/requests/{bfcl450,bfcl450_structured,glaive650,train}.jsonl`` plus
``stats.json`` and ``rejected.jsonl`` (every skipped record, named, with its reason).
"""

from __future__ import annotations

import sys
from pathlib import Path

from data_gen.continuations import build_continuations
from data_gen.corpora import bfcl_categories, bfcl_data_dir, bfcl_version, load_bfcl, load_glaive
from data_gen.splits import make_splits
from schemafill import atomic
from schemafill.config import PipelineConfig, to_dict
from schemafill.contract.records import RejectLog, read_requests, write_requests
from schemafill.fingerprint import fingerprint, load_if_fresh, write_manifest
from schemafill.tracking import NullTracker, Tracker


def requests_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.paths.artifacts) / "requests"


def build_requests(cfg: PipelineConfig, tracker: Tracker | None = None) -> dict:
    tracker = tracker or NullTracker()
    out_dir = requests_dir(cfg)
    bfcl_dir = bfcl_data_dir(cfg.data.bfcl_dir)
    corpus = {k: v for k, v in to_dict(cfg.data).items() if k != "continuations"}
    fp = fingerprint({
        "data": corpus,
        "bfcl": bfcl_version(bfcl_dir),
        "extra": [_file_stamp(p) for p in cfg.data.extra_requests],
        "format": 2,
    })
    outputs = ["bfcl450.jsonl", "bfcl450_structured.jsonl", "train.jsonl", "stats.json"]
    if (stats := load_if_fresh("requests", out_dir, fp, outputs, "stats.json", _counts)) is not None:
        return {**stats, "cached": True}

    log = RejectLog(strict=cfg.data.strict)
    bfcl = load_bfcl(bfcl_dir, bfcl_categories(bfcl_dir), log)
    glaive = []
    if cfg.data.glaive:
        glaive = load_glaive(cfg.data.glaive, cfg.data.glaive_split, log, limit=cfg.data.glaive_limit)
    else:
        print("[requests] Glaive not configured (data.glaive=null): glaive650 is skipped; "
              "set data=bfcl_glaive or data.glaive=<hub id or local path> to add it")
    extra = []
    for path in cfg.data.extra_requests:
        extra += read_requests(path, log)[0]

    splits = make_splits(bfcl + extra, glaive, seed=cfg.data.seed, glaive_eval_size=cfg.data.glaive_eval_size)
    for name, reqs in splits.eval_sets.items():
        write_requests(out_dir / f"{name}.jsonl", reqs)
    write_requests(out_dir / "train.jsonl", splits.train)
    atomic.write_jsonl(out_dir / "rejected.jsonl", [r.__dict__ for r in log.items])
    stats = {**splits.stats, "loaded": {"bfcl": len(bfcl), "glaive": len(glaive), "extra": len(extra)},
             "rejected": len(log), "rejected_by_reason": log.counts()}
    atomic.write_json(out_dir / "stats.json", stats)
    write_manifest(out_dir, fp, stage="requests")

    print(f"[requests] {log.summary()}")
    print(f"[requests] wrote {out_dir}: {_counts(stats)}")
    tracker.summary({"requests/train": stats["train"], **{f"requests/{k}": v for k, v in stats["eval"].items()}})
    return {**stats, "cached": False}


def _counts(stats: dict) -> str:
    evals = ", ".join(f"{k}={v}" for k, v in stats["eval"].items())
    return f"{evals}, train={stats['train']} (dropped {stats['dropped']}), rejected={stats['rejected']}"


def _file_stamp(path: str) -> list:
    p = Path(path)
    return [str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size] if p.exists() else [str(p), None]


STAGES = {"requests": build_requests, "continuations": build_continuations}


def run(cfg: PipelineConfig, tracker: Tracker | None = None) -> dict:
    """Run the data stages named in ``cfg.stages``."""
    other = [s for s in cfg.stages if s not in STAGES]
    if other:
        raise ValueError(f"{other} are not data stages (these are {list(STAGES)}); run them with train/run.py")
    return {stage: STAGES[stage](cfg, tracker) for stage in cfg.stages}


if __name__ == "__main__":
    import hydra
    from omegaconf import DictConfig

    from schemafill.config import register_configs, to_dataclass

    register_configs()

    @hydra.main(config_path="../conf", config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        run(to_dataclass(cfg))

    sys.exit(_main())
