"""Seconds by phase of one decode (``Decoded.times``; the paper's Table 5 breakdown)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Phases:
    """``with phases("drafting"): ...`` adds the block's wall time to that phase."""

    def __init__(self, *names: str) -> None:
        self.times: dict[str, float] = dict.fromkeys(names, 0.0)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.times:
            raise KeyError(f"unknown phase {name!r}; the phases are {list(self.times)}")
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] += time.perf_counter() - t
