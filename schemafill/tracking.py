"""Experiment tracking. The only module that imports ``wandb``.

One run per invocation: the resolved config plus provenance (git SHA, package versions,
hardware), then metrics, tables, images and artifacts. ``logger.backend=none`` (and
tests) get ``NullTracker``, which keeps what it was given in memory and sends nothing.
``logger.mode=auto`` runs online when an API key is configured and offline otherwise,
so a machine without network still records every run under ``wandb/`` for a later sync.
"""

from __future__ import annotations

import netrc
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from schemafill.config import LoggerConfig

_PACKAGES = ("schemafill", "torch", "transformers", "accelerate", "datasets", "deepspeed", "hydra-core", "wandb")


def git_sha(path: str | os.PathLike | None = None) -> str | None:
    cwd = Path(path) if path else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        import torch

        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def provenance() -> dict[str, Any]:
    """What produced a result: recorded in every run and every stage's metadata."""
    return {"git_sha": git_sha(), "packages": package_versions(), "hardware": hardware()}


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if has_api_key() else "offline"


@dataclass
class NullTracker:
    """Sends nothing; keeps what it was given so callers (and tests) can read it back."""

    history: list[dict] = field(default_factory=list)
    summaries: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    artifacts: list[tuple[str, str, str]] = field(default_factory=list)
    images: dict = field(default_factory=dict)

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.history.append({**metrics, **({"_step": step} if step is not None else {})})

    def summary(self, metrics: dict) -> None:
        self.summaries.update(metrics)

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.tables[name] = (columns, rows)

    def image(self, name: str, path: str | os.PathLike) -> None:
        self.images[name] = str(path)

    def artifact(self, path: str | os.PathLike, name: str, kind: str) -> None:
        self.artifacts.append((str(path), name, kind))

    def finish(self) -> None:
        pass


class WandbTracker:
    def __init__(self, cfg: LoggerConfig, config: dict, name: str | None, job_type: str) -> None:
        import wandb

        self._wandb = wandb
        Path(cfg.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, mode=resolve_mode(cfg.mode), dir=cfg.dir,
            name=name, job_type=job_type, group=cfg.group, tags=list(cfg.tags) or None,
            config={**config, "_provenance": provenance()},
        )

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def summary(self, metrics: dict) -> None:
        self.run.summary.update(metrics)

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)})

    def image(self, name: str, path: str | os.PathLike) -> None:
        self.run.log({name: self._wandb.Image(str(path))})

    def artifact(self, path: str | os.PathLike, name: str, kind: str) -> None:
        art = self._wandb.Artifact(name=name, type=kind)
        if Path(path).is_dir():
            art.add_dir(str(path))
        else:
            art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self) -> None:
        self.run.finish()


Tracker = NullTracker | WandbTracker


def start_run(cfg: LoggerConfig, config: dict, name: str | None = None, job_type: str = "pipeline") -> Tracker:
    if cfg.backend == "none" or cfg.mode == "disabled":
        return NullTracker()
    if cfg.backend != "wandb":
        raise ValueError(f"unknown logger.backend {cfg.backend!r}; expected 'wandb' or 'none'")
    return WandbTracker(cfg, config, name, job_type)
