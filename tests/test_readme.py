"""The README's Python quickstart runs as a user would paste it: from a folder holding
``artifacts/`` (the built-in target's weights, a head), decoding its request with SchemaFill."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def python_quickstart() -> str:
    """The code block under the README's "From Python"."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*From Python\*\*.*?```python\n(.*?)```", readme, re.S)
    assert block, "README.md has no Python block under **From Python**"
    return block.group(1)


def test_the_readme_python_quickstart_decodes_its_request(builtin_artifacts, tmp_path):
    from schemafill.runtime.drafter import save_head
    from schemafill.runtime.loading import load_target
    from tests.decoders.test_schemafill import random_head

    # the artifacts a `make run` leaves, stood in for: the base weights as the fine-tuned
    # target (the snippet loads that folder), and a random head of the built-in target's shape
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    (tmp_path / "artifacts" / "targets").mkdir(parents=True)
    (tmp_path / "artifacts" / "targets" / "smollm2-135m").symlink_to(base.resolve(), target_is_directory=True)
    target = load_target(base, torch.float32, torch.device("cpu"), aux_layer_ids=[2, 15, 27], backend="eager")
    save_head(random_head(target), tmp_path / "artifacts" / "heads" / "smollm2-135m")

    snippet = python_quickstart()
    short = snippet.replace('["model=smollm2-135m"]', '["model=smollm2-135m", "decode.max_new_tokens=24"]')
    assert short != snippet, "the quickstart no longer composes its config with model=smollm2-135m"
    done = subprocess.run([sys.executable, "-c", short], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    *text, accept_length = done.stdout.strip().splitlines()[-1].split(" ")
    assert text and float(accept_length) >= 1.0, done.stdout[-2000:]
