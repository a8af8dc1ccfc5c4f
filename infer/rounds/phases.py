"""Seconds by phase of one decode (``Decoded.times``; the paper's Table 5 breakdown)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Phases:
    """``with phases("drafting"): ...`` adds the block's wall time to that phase. A phase
    opened inside another pauses it, so every second is counted once: the round loop times
    its steps and a method names the parts of a step that belong elsewhere."""

    def __init__(self, *names: str) -> None:
        self.times: dict[str, float] = dict.fromkeys(names, 0.0)
        self._open: list[str] = []
        self._since = 0.0

    def add(self, *names: str) -> None:
        """Phases a method times beside the loop's."""
        for name in names:
            self.times.setdefault(name, 0.0)

    def charge(self, name: str, seconds: float) -> None:
        """Add time spent elsewhere to a phase (a batch's shared forward)."""
        self.times[name] += seconds

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.times:
            raise KeyError(f"unknown phase {name!r}; the phases are {list(self.times)}")
        self._switch()
        self._open.append(name)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def _switch(self) -> None:
        """Charge the time since the last switch to the innermost open phase."""
        now = time.perf_counter()
        if self._open:
            self.times[self._open[-1]] += now - self._since
        self._since = now
