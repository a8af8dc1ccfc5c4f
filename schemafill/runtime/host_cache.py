"""Measurements cached on disk per host: the precision probe, the product-kernel probe and the
cost curve each keep one JSON file per key (what the timings depend on: host, shape, build), so
a launch reads what an earlier one timed instead of timing again. An entry is used only when
its stored key is this one; a missing, damaged or foreign entry reads as nothing (measured
again), and a cache that cannot be written is said, never fatal. A probe that times while
another process probes the same entry would time both under contention, so ``measuring``
lets one measure while the others wait, then read what it wrote."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from schemafill import atomic


def folder(kind: str) -> Path:
    """``$XDG_CACHE_HOME/schemafill/<kind>`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "schemafill" / kind


def entry(where: str | os.PathLike, name: str) -> Path:
    """The file of the entry called ``name`` under ``where``."""
    return Path(where) / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"


def read(path: Path, key: str) -> dict[str, Any] | None:
    """The entry at ``path`` if it was written for ``key``, else None."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return saved if isinstance(saved, dict) and saved.get("key") == key else None


def write(path: Path, key: str, payload: dict[str, Any], what: str) -> None:
    """Store ``payload`` under ``key`` atomically; a read-only home still runs (it measures again next time)."""
    try:
        atomic.write_json(path, {**payload, "key": key})
    except OSError as err:
        print(f"[cache] could not cache {what} at {path}: {err}")


@contextlib.contextmanager
def measuring(path: Path) -> Iterator[None]:
    """Hold the entry at ``path`` for measuring: another process measuring it waits here until
    this one is done (then reads the entry instead of timing beside it). Without a writable
    cache folder there is nothing to share, and nothing is held."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
