"""Shared fixtures: the real config tree composed by Hydra, shrunk to a temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose(overrides: list[str] | None = None):
    """The DictConfig `train/run.py` would get for these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from schemafill.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def make_cfg(tmp_path):
    """Build a PipelineConfig writing under tmp_path, with tracking off unless asked."""
    from schemafill.config import to_dataclass

    def _make(*overrides: str):
        base = [f"paths.artifacts={tmp_path / 'artifacts'}", "logger=none"]
        return to_dataclass(compose(base + list(overrides)))

    return _make
