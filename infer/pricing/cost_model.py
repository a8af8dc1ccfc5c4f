"""What one verification costs on the hardware it runs on: ``c(n)``, the target's forward
over ``n`` tree rows at a typical context, measured at start-up and cached per host.

On a few-core CPU a row costs milliseconds and ``c(n)`` grows steeply with ``n``; on a GPU a
forward is bound by streaming the weights and ``c(64)`` is close to ``c(1)``. A fixed node
budget cannot be right on both, so the decoders choose their nodes against this measured
curve (``infer/pricing/selection.py``).

How it is measured (``measure``): a random chain of ``n`` rows after ``context`` committed
positions, for each ``n`` in ``SIZES`` (a tree of ``n`` rows costs what a chain does: the mask
differs, not the work), logits at every row as a verification computes them; each size is
warmed up once, then timed ``repeats`` times with the sizes round-robin so that a slow
moment of the host spreads over all of them rather than landing on one; the median of each
size is its point. ``CostModel`` reads the points by linear interpolation (extrapolated
along the last segment), made non-decreasing so noise never makes a bigger tree look
cheaper: the closest non-decreasing curve (adjacent violators pooled into their mean), so
one slow sample is averaged with its neighbours instead of lifting every size after it.
``load_or_measure`` keeps the result in a JSON file keyed by what the time depends on: the
target's weights, device, dtype, the host's CPU capability, thread count and torch build;
each launch times one one-row call against it and measures the curve again when the two
disagree by more than a quarter (a curve cached in a busy hour would price every later launch).

``LiveCost`` corrects that curve with the launch's own verifications. The start-up chains
are not what a decoder sends: a tree at a longer context, SIDE rows whose private contexts
sit far past MAIN's (their attention is computed apart), and a host that has warmed up or
slowed down since the curve was cached. It keeps the mean difference between measured and
predicted milliseconds per size bucket, apart for calls with SIDE rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from schemafill.runtime import host_cache
from schemafill.runtime.model import Target
from schemafill.runtime.timing import alternating_ms, median_ms

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostModel:
    sizes: tuple[int, ...]  # rows per forward, increasing
    ms: tuple[float, ...]  # measured milliseconds of each
    context: int = 0  # committed positions the rows attended to
    key: str = ""  # what it was measured on (``host_key``)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.ms) or not self.sizes:
            raise ValueError(f"a cost model needs one time per size, got {self.sizes} and {self.ms}")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be increasing positive row counts, got {self.sizes}")
        if any(b < a for a, b in zip(self.ms, self.ms[1:])):  # a bigger forward never costs less
            raise ValueError(f"a cost curve must not decrease, got {self.ms}: build measured times with CostModel.fit")

    @classmethod
    def fit(cls, sizes: tuple[int, ...], measured: tuple[float, ...], context: int = 0, key: str = "") -> "CostModel":
        """The curve through measured times: the closest non-decreasing one (module docstring)."""
        return cls(tuple(sizes), tuple(round(v, 3) for v in isotonic(measured)), context, key)

    def __call__(self, n: int) -> float:
        """Milliseconds of one forward over ``n`` rows (n ≥ 1)."""
        return interpolate(self.sizes, self.ms, n, extrapolate=True)

    def linear_fit(self) -> tuple[float, float]:
        """Least squares ``c(n) ≈ a + b·n`` (ms, ms per row): the one-line summary a report prints."""
        return line_fit(self.sizes, self.ms) or (self.ms[0], 0.0)

    def summary(self) -> dict:
        a, b = self.linear_fit()
        return {**asdict(self), "fit_ms": round(a, 3), "fit_ms_per_row": round(b, 4),
                "ratio_64_to_1": round(self(64) / self(1), 3)}


def size_bucket(n: int) -> int:
    """The calls a measured time is pooled with: up to 8 rows each size alone (a CPU's matrix
    kernels change at small sizes, so 4 rows may cost far more than 3), then powers of two."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


@dataclass
class LiveCost:
    """The start-up curve plus what this launch's verifications measured: per size bucket, and
    apart for calls with and without SIDE rows, the mean difference between the time a call
    took and the curve's, shrunk toward 0 by ``strength`` pseudo-observations. One slow call
    (a page fault, the host's other work) moves its bucket by at most the curve's own value.

    The corrected curve is continuous and never decreases: each bucket's correction sits at the
    mean size of the calls it pooled, sizes between two such points take a correction in
    proportion, and the corrected times at those points are made non-decreasing the way the
    start-up curve is. A correction that stepped at a bucket's edge would price the row that
    crosses it at the whole step, and where a bigger bucket measured below a smaller one's
    (batched calls of many requests pay per request, not per row), selection would add rows
    only to make a call cheaper."""

    base: CostModel
    learn: bool = True  # False: the curve alone (selection that never depends on timing)
    strength: float = 4.0
    residual: dict[tuple[int, bool], float] = field(default_factory=dict)  # summed (measured - curve) ms
    calls: dict[tuple[int, bool], int] = field(default_factory=dict)
    rows: dict[tuple[int, bool], int] = field(default_factory=dict)  # summed rows of the calls
    per_row: float = field(init=False)  # the curve's ms per row (its linear fit's slope)
    _points: dict[bool, tuple[list[float], list[float]]] = field(init=False, default_factory=dict)
    _ms: dict[tuple[int, bool], float] = field(init=False, default_factory=dict)  # until the next observation

    def __post_init__(self) -> None:
        self.per_row = self.base.linear_fit()[1]

    def __call__(self, n: int, side: bool = False) -> float:
        """Milliseconds of a call of ``n`` rows, ``side``: some of them SIDE rows."""
        ms = self._ms.get((n, side))
        if ms is None:  # a batch's round asks for every size up to all of its candidates
            xs, corr = self._corrections(side)
            ms = self._ms[n, side] = self.base(n) + (interpolate(xs, corr, n) if xs else 0.0)
        return ms

    def _corrections(self, side: bool) -> tuple[list[float], list[float]]:
        """The measured points of the curve for ``side`` calls: mean sizes, and the correction
        at each once the corrected times are made non-decreasing (cached until the next call)."""
        if side not in self._points:
            keys = sorted((k for k in self.calls if k[1] == side), key=lambda k: self.rows[k] / self.calls[k])
            xs = [self.rows[k] / self.calls[k] for k in keys]
            shrunk = [self.residual[k] / (self.calls[k] + self.strength) for k in keys]
            times = isotonic([self.base(x) + c for x, c in zip(xs, shrunk)])
            self._points[side] = (xs, [t - self.base(x) for x, t in zip(xs, times)])
        return self._points[side]

    def observe(self, rows: int, side: bool, ms: float) -> None:
        """A verification of ``rows`` rows took ``ms``."""
        if not self.learn:
            return
        key, base = (size_bucket(rows), side), self.base(rows)
        self.residual[key] = self.residual.get(key, 0.0) + min(max(ms - base, -0.5 * base), base)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.rows[key] = self.rows.get(key, 0) + rows
        self._points.pop(side, None)
        self._ms.clear()

    def summary(self) -> dict:
        """The curve, and per bucket seen, the calls, their mean size and mean correction (ms),
        and what the corrected curve says at that size."""
        return {**self.base.summary(), "measured": {f"{n}{'+side' if side else ''}": {
            "calls": c, "mean_rows": round(self.rows[(n, side)] / c, 2),
            "ms": round(self(self.rows[(n, side)] / c, side), 2),
            "correction_ms": round(self.residual[(n, side)] / c, 2)}
            for (n, side), c in sorted(self.calls.items())}}


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float, extrapolate: bool = False) -> float:
    """The piecewise-linear curve through ``(xs, ys)`` (xs increasing) at ``x``: flat below the
    first point; past the last, flat or (``extrapolate``) along the last segment."""
    i = bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        if not extrapolate or len(xs) == 1:
            return ys[-1]
        i -= 1
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares ``y ≈ a + b·x``: ``(a, b)``, or None when every x is the same."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


def isotonic(values: tuple[float, ...] | list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in squared error (pool adjacent
    violators: a run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def host_key(target: Target, device: torch.device, dtype: torch.dtype) -> str:
    """What a forward's time depends on, as one string: the target's shape and a sample of its
    weights, the device, dtype, the CPU capability ATen dispatches to, the thread count, and
    its backend with the choices its load measured (``Backend.key``)."""
    c = target.config
    w = target.lm_head.weight
    probe = w.detach().flatten()[:: max(1, w.numel() // 4096)].float().cpu().numpy().tobytes()
    weights = hashlib.sha256(probe).hexdigest()[:12]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return (f"{c.family}-L{c.num_layers}-H{c.hidden_size}-V{c.vocab_size}-{weights}|{device.type}{gpu}|"
            f"{str(dtype).removeprefix('torch.')}|{torch.backends.cpu.get_cpu_capability()}|"
            f"threads{torch.get_num_threads()}|torch{torch.__version__}|{target.runs_on().name}:"
            f"{target.runs_on().key()}")


@torch.inference_mode()
def measure(target: Target, context: int = 512, sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> CostModel:
    """Time the target on a chain of ``n`` rows after ``context`` committed positions (a tree
    of n rows costs what a chain does: the mask differs, not the work), logits at every row as
    a verification computes them. Median of ``repeats`` rounds over every size, after one
    warm-up of each."""
    calls = verification_calls(target, context, sizes)
    return CostModel.fit(tuple(sizes), tuple(alternating_ms(calls, target.device, repeats)), context)


def still_holds(target: Target, cached: CostModel, tolerance: float = 0.25, floor_ms: float = 5.0,
                repeats: int = 3) -> bool:
    """Whether a one-row call still costs what ``cached`` says, within ``tolerance`` (and
    ``floor_ms``, below which timings are noise): a curve cached in a busy or slow hour would
    otherwise price every later launch on this host."""
    (call,) = verification_calls(target, cached.context, (1,))
    now = median_ms(call, target.device, repeats)
    return abs(now - cached(1)) <= max(tolerance * cached(1), floor_ms)


@torch.inference_mode()
def verification_calls(target: Target, context: int, sizes: tuple[int, ...]) -> list:
    """One call per size: ``n`` new rows after ``context`` committed positions (prefilled
    once here), logits at every row; each call writes the same slots, so any may repeat."""
    dev = target.device
    g = torch.Generator().manual_seed(0)
    width = context + max(sizes)
    arena = target.new_arena(1, width)
    tokens = torch.randint(0, target.config.vocab_size, (1, width), generator=g).to(dev)
    positions = torch.arange(width, device=dev)[None]
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None]
    target(tokens[:, :context], positions[:, :context], causal[:, :context, :context], positions[:, :context], arena,
           logits_at=torch.tensor([[context - 1]], device=dev))
    calls = []
    for n in sizes:
        sl = slice(context, context + n)
        args = (tokens[:, sl], positions[:, sl], causal[:, sl, : context + n], positions[:, sl], arena)
        calls.append(lambda args=args: target(*args))
    return calls


def load_or_measure(target: Target, cache_dir: str | os.PathLike, context: int = 512,
                    sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> tuple[CostModel, bool]:
    """The cached curve for this (target, device, dtype, host), measuring it on a miss or when
    a quick check of c(1) no longer agrees with it (``still_holds``). Returns (model, measured_now)."""
    key = host_key(target, target.device, target.dtype)
    path = host_cache.entry(cache_dir, f"{key}|{context}|{sizes}")
    saved = host_cache.read(path, key)
    if saved is not None:
        try:
            cached = CostModel(tuple(saved["sizes"]), tuple(saved["ms"]), saved["context"], key)
            if still_holds(target, cached):
                return cached, False
            print("[infer] the cached cost curve no longer matches this host's c(1): measuring it again")
        except (KeyError, TypeError, ValueError):
            pass  # a damaged cache entry is measured again and overwritten
    model = dataclasses.replace(measure(target, context, sizes, repeats), key=key)
    host_cache.write(path, key, model.summary(), "the cost curve")
    return model, True
