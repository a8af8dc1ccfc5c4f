"""Timing work on a device: wall-clock milliseconds with the device synchronised around the
call (a GPU runs asynchronously; a CPU has finished when the call returns). Every measured
forward of the project — the cost curve, the benchmarks, the precision probe — is timed here."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - start)


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeats))


def alternating_ms(calls: list[Callable[[], Any]], device: torch.device, repeats: int) -> list[float]:
    """Median milliseconds of each of ``calls``, after one warm-up of each, timed in turn round
    after round: a host that drifts or is busy with something else slows them alike."""
    for fn in calls:
        fn()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, fn in enumerate(calls):
            times[i].append(elapsed_ms(fn, device))
    return [statistics.median(t) for t in times]
