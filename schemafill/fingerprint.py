"""Content fingerprints that key cached artifacts: a stage reruns only when what it
depends on (its config section, its input files, the packages that produce its data)
changed. A manifest beside each artifact records the fingerprint it was built from."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from schemafill import atomic

MANIFEST = "manifest.json"


def fingerprint(obj: Any) -> str:
    """Stable 16-hex digest of a JSON-able object."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()[:16]


def read_manifest(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def is_fresh(folder: str | os.PathLike, fp: str, outputs: list[str]) -> bool:
    """True when ``folder`` holds every output, built from fingerprint ``fp``."""
    manifest = read_manifest(folder)
    return (
        manifest is not None and manifest.get("fingerprint") == fp
        and all((Path(folder) / name).exists() for name in outputs)
    )


def load_if_fresh(stage: str, folder: str | os.PathLike, fp: str, outputs: list[str], result: str,
                  describe: Callable[[dict], str] | None = None, quiet: bool = False) -> dict | None:
    """A stage's stored ``result`` (a JSON file among ``outputs``) when ``folder`` is fresh
    for ``fp``, after saying so (``describe`` adds a summary); None when the stage must run."""
    if not is_fresh(folder, fp, outputs):
        return None
    stored = json.loads((Path(folder) / result).read_text())
    if not quiet:
        print(f"[{stage}] up to date in {folder} (fingerprint {fp})" + (f": {describe(stored)}" if describe else ""))
    return stored


def write_manifest(folder: str | os.PathLike, fp: str, **extra: Any) -> None:
    atomic.write_json(Path(folder) / MANIFEST, {"fingerprint": fp, **extra})
