"""A target's matrix products on a CPU: three kernels that give the same numbers up to
rounding at very different speeds, and the plan that picks one per row count from a timed
probe of the target's own projections. On some CPUs the BLAS's one-row and few-row products
stream the weights at under half the host's read rate.

* ``plain`` — ``F.linear``, the BLAS's own choice;
* ``transposed`` — ``(W @ xᵀ)ᵀ``, a lone row padded to two: a product with a few columns,
  which streams the weights once where the BLAS's few-row kernel does not;
* ``packed`` — oneDNN's product over a copy of W prepacked in its blocked layout, a lone
  row padded to two: its one-row kernel differs from its many-row one, and padded every row
  gets the same numbers whatever the call's row count (what the batch-invariant backend
  uses where it has no bf16 product of its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from schemafill.runtime import host, host_cache
from schemafill.runtime.timing import alternating_ms

KERNELS = ("plain", "transposed", "packed")
# row counts the probe times; a count between two takes the larger one's kernel
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
TRANSPOSED_ROWS = 16  # past this many rows the transposed product is the plain one


@dataclass
class Products:
    """A kernel per row count for every projection of one target (``plan``: (most rows, kernel)
    ascending; past the last, its kernel), with oneDNN's packed copy of each weight the plan
    uses (not parameters). Called as the model's ``product``."""

    plan: tuple[tuple[int, str], ...] = ()
    packed: dict[nn.Linear, torch.Tensor] = field(default_factory=dict)

    def kernel(self, rows: int) -> str:
        return kernel_at(self.plan, rows)

    def __call__(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # [..., In] -> [..., Out]
        rows = x.numel() // x.shape[-1]
        y = product(linear, x.reshape(rows, -1), self.kernel(rows), self.packed.get(linear))
        return y.reshape(*x.shape[:-1], -1)

    def describe(self) -> str:
        """The plan in a few characters (``4:transposed,128:packed``)."""
        return ",".join(f"{rows}:{kernel}" for rows, kernel in self.plan)


def kernel_at(plan: tuple[tuple[int, str], ...], rows: int) -> str:
    """The kernel ``plan`` gives ``rows`` rows: the first entry holding them, else the last's."""
    for most, kernel in plan:
        if rows <= most:
            return kernel
    return plan[-1][1] if plan else "plain"


def product(linear: nn.Linear, x: torch.Tensor, kernel: str, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``linear``'s product with ``x`` [N, In] on ``kernel`` (``packed``: oneDNN's copy of its weight)."""
    return on_weights(x, linear.weight, linear.bias, kernel, packed)


def on_weights(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str,
               packed: torch.Tensor | None = None) -> torch.Tensor:  # [N, In] -> [N, Out]
    """``x Wᵀ + b`` on ``kernel``, from the weight's tensors."""
    if kernel == "plain":
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = torch.cat((x, x)) if rows == 1 else x  # cat: a few µs less than repeat, per product
    if kernel == "packed":
        y = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
    else:
        y = (weight @ padded.T).T.contiguous()  # row-major, as attention's kernels need
        y = y if bias is None else y + bias
    return y[:rows]


def pack(linear: nn.Linear) -> torch.Tensor:
    """oneDNN's prepacked copy of ``linear``'s weight (its layout for any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)


@lru_cache(maxsize=4)
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks ``dtype`` weights here (its bf16 packing needs AVX512 or AVX-NE-CONVERT;
    ``ONEDNN_MAX_CPU_ISA`` may withhold them): tried on a small weight."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def room_to_pack(weight_bytes: int, available: int | None, share: float = 0.5) -> bool:
    """Whether a copy of the weights (as many bytes again) fits in ``share`` of the free
    memory: a target near the host's memory keeps the kernels that need no copy."""
    return available is None or weight_bytes <= share * available


def weight_bytes(linears: list[nn.Linear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def plan_of(choices: dict[int, str]) -> tuple[tuple[int, str], ...]:
    """The kernel plan from the fastest kernel per probed row count: runs of one kernel merged;
    a row count past the last probed one keeps the last kernel."""
    plan: list[tuple[int, str]] = []
    for rows in sorted(choices):
        if plan and plan[-1][1] == choices[rows]:
            plan[-1] = (rows, choices[rows])
        else:
            plan.append((rows, choices[rows]))
    return tuple(plan)


def probe_key(linears: list[nn.Linear], dtype: torch.dtype, packable: bool) -> str:
    """What the probe's timings depend on: every projection's shape, the dtype, whether the
    packed kernel is in the running, the host and the torch build."""
    shapes = sorted({(m.out_features, m.in_features) for m in linears})
    return "|".join([json.dumps(shapes), f"x{len(linears)}", str(dtype), f"packed{int(packable)}", *host.timing_key()])


@torch.inference_mode()
def probe(linears: list[nn.Linear], kernels: tuple[str, ...], packed: dict[nn.Linear, torch.Tensor],
          repeats: int = 3) -> dict[int, dict[str, float]]:
    """Milliseconds of all of a target's projections (each over its own weights, so they
    stream from memory as in a forward) at each of ``PROBE_ROWS``, per kernel, kernels timed
    in turn."""
    weight = linears[0].weight
    g = torch.Generator().manual_seed(0)
    timings: dict[int, dict[str, float]] = {}
    for rows in PROBE_ROWS:
        inputs = {n: torch.randn(rows, n, generator=g).to(weight.dtype) for n in {m.in_features for m in linears}}
        names = kernels_at(rows, kernels)

        def sweep(kernel: str) -> None:
            for m in linears:
                product(m, inputs[m.in_features], kernel, packed.get(m))

        ms = alternating_ms([lambda k=k: sweep(k) for k in names], weight.device, repeats)
        timings[rows] = dict(zip(names, ms))
    return timings


def kernels_at(rows: int, kernels: tuple[str, ...]) -> list[str]:
    """The kernels worth timing at ``rows`` rows."""
    return [k for k in kernels if k != "transposed" or rows <= TRANSPOSED_ROWS]


def complete(timings: dict[int, dict[str, float]], kernels: tuple[str, ...]) -> bool:
    """Whether cached timings cover every probed row count with every kernel worth timing there."""
    return sorted(timings) == list(PROBE_ROWS) and all(set(kernels_at(rows, kernels)) <= set(t)
                                                      for rows, t in timings.items())


def tuned(linears: list[nn.Linear], cache_dir: Path | None = None) -> Products:
    """Time ``linears`` (a target's projections) at 1-128 rows with each kernel and give every
    row count the fastest. A few seconds, cached per host and shape like the precision probe."""
    dtype = linears[0].weight.dtype
    packable = packs(dtype)
    size = weight_bytes(linears)
    if packable and not room_to_pack(size, host.available_memory()):
        print(f"[runtime] {size / 1e9:.1f} GB of weights: no room for their packed copies, "
              f"so the products use the kernels that need none")
        packable = False
    kernels = KERNELS if packable else tuple(k for k in KERNELS if k != "packed")
    packed = {m: pack(m) for m in linears} if packable else {}
    key = probe_key(linears, dtype, packable)
    path = host_cache.entry(cache_dir or host_cache.folder("products"), key)
    saved = host_cache.read(path, key)
    try:
        timings = {int(r): {k: float(ms) for k, ms in t.items()} for r, t in saved["timings"].items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        timings = None  # no entry, or a damaged one
    if timings is None or not complete(timings, kernels):
        timings = probe(linears, kernels, packed)
        host_cache.write(path, key, {"timings": timings}, "the product probe")
    plan = plan_of({rows: min((k for k in t if k in kernels), key=t.get) for rows, t in timings.items()})
    keep_packed = any(kernel == "packed" for _, kernel in plan)
    return Products(plan, packed if keep_packed else {})


def packed_everywhere(linears: list[nn.Linear]) -> Products:
    """oneDNN's padded packed product at every row count: a row's numbers do not depend on the
    call's other rows (the batch-invariant backend's products where it has none of its own)."""
    return Products(((PROBE_ROWS[-1], "packed"),), {m: pack(m) for m in linears})
