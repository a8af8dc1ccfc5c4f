"""Decode a requests file with several methods on one runtime, side by side.

    python infer/run.py requests=artifacts/requests/bfcl450.jsonl methods=[ar,eagle3] out=outputs/bfcl

Writes ``<out>/metrics.json`` (per method: accept length, tokens/s, AR agreement, ...) and
``<out>/outputs/<method>.jsonl``, one line per request (``infer/eval/launch.py`` says what each
holds). ``python infer/run.py --help`` lists the settings (``conf/infer.yaml``).
``run(cfg) -> dict`` is what tests, benchmarks and the eval stage call.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from infer.eval.launch import run
from schemafill.config import InferConfig, register_configs, to_dataclass

__all__ = ["run"]

register_configs()


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(to_dataclass(cfg, InferConfig))


if __name__ == "__main__":
    sys.exit(main())
