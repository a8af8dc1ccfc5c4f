"""Serve SchemaFill decoding behind the OpenAI chat-completions API.

    python infer/serve.py model=smollm2-135m method=schemafill port=8000

``POST /v1/chat/completions`` (``messages``, ``tools``, ``tool_choice``, ``temperature``,
``top_p``, ``seed``, ``max_tokens``, ``stream``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus). The target and head load once; up to ``max_batch`` requests
decode together, one target forward per round (``infer/serving/engine.py``). ``tool_choice: required`` or a named function decodes
under the response grammar, so the call always parses and validates; ``auto`` decodes
free; ``none`` returns the response as content. Answers are the decoders' own tokens:
lossless methods answer exactly what greedy AR would. ``run(cfg) -> dict`` serves until
interrupted. ``python infer/serve.py --help`` lists the settings (``conf/serve.yaml``).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from infer.serving.app import BackgroundServer
from infer.serving.engine import Engine
from schemafill.config import ServeConfig, register_configs, to_dataclass


def run(cfg: ServeConfig) -> dict:
    engine = Engine(cfg)
    print(f"[serve] models {list(engine.models)} (methods {list(engine.decoders)}) on "
          f"http://{cfg.host}:{cfg.port}/v1; up to {cfg.max_batch} decode together, {cfg.queue_size} more may wait")
    # HTTP on a thread, decoding on this one (``Engine.start`` says why); Ctrl-C stops both
    with BackgroundServer(engine, cfg.host, cfg.port, log_level="info", decode_here=True):
        try:
            engine.run()
        except KeyboardInterrupt:
            pass
        finally:
            engine.close()
    return {"models": list(engine.models), "url": f"http://{cfg.host}:{cfg.port}/v1"}


register_configs()


@hydra.main(config_path="../conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(to_dataclass(cfg, ServeConfig))


if __name__ == "__main__":
    sys.exit(main())
