"""Batch-invariant kernels on a CPU — attention, the residual add with RMSNorm, SiLU·mul, the
products and a whole layer in one call, in fp32 and bf16 — from ``batch_invariant.c``, built for this host
with the system's C compiler and loaded through ctypes (the batch-invariant backend's kernels:
``runtime/backends/batch_invariant.py``).

A query row gets the same bits from it whatever else its call holds (how many rows, which
slots around its own are masked), so a verification row equals the one-row AR step at the
same position bit for bit whenever the row's visible keys sit in slot order by position —
as MAIN's do. With products that are row-invariant too (oneDNN's padded packed kernel:
``runtime/products.py``, or ``product`` here), a whole forward is: the decoders may then verify
in bf16 and still give AR's tokens.

The library is compiled once per host (its ISA as torch sees it, the compiler, the source)
under ``$XDG_CACHE_HOME/schemafill/kernels``; without a compiler or OpenMP the runtime says
so and keeps SDPA (``available`` is then False). It links the OpenMP runtime torch has
already loaded, so its threads are torch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from schemafill.runtime import host, host_cache

SOURCE = Path(__file__).parent / "batch_invariant.c"
# flags by the ISA torch runs at (``ATEN_CPU_CAPABILITY`` lowers it; the kernel follows)
ISA_FLAGS = {"AVX512": ["-march=native", "-mprefer-vector-width=512"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def compile_flags() -> list[str]:
    return ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Werror=implicit-function-declaration",
            *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=4)
def library_path(cc: str) -> Path:
    """Where this host's build of the kernel lives: named by everything its code depends on."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = "|".join([SOURCE.read_text(), *compile_flags(), *version, host.cpu_model()])
    return host_cache.folder("kernels") / f"batch_invariant-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(cc: str, path: Path) -> None:
    """Compile into a temporary sibling and rename: a reader never loads half a library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        done = subprocess.run([cc, *compile_flags(), str(SOURCE), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(out, path)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built here (said once)."""
    cc = compiler()
    if cc is None:
        print("[runtime] no C compiler: attention stays on SDPA, and verification is not batch-invariant")
        return None
    try:
        path = library_path(cc)
        if not path.exists():
            start = time.perf_counter()
            build(cc, path)
            print(f"[runtime] built the batch-invariant kernels in {time.perf_counter() - start:.1f} s ({path})")
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        print(f"[runtime] batch-invariant attention unavailable ({err}); attention stays on SDPA")
        return None
    i, i64, p, f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for fn in (lib.attend_f32, lib.attend_bf16):
        fn.restype = None
        fn.argtypes = [i, i, i, i, i, p, i64, i64, i64, p, p, i64, i64, p, i64, i64, i, p, i64, i64, i64, f]
    for fn in (lib.rope_attend_f32, lib.rope_attend_bf16):
        fn.restype = None
        fn.argtypes = [i, i, i, i, i, p, i64, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, p, i64, i64, p, i64,
                       p, p, i64, i64, p, i64, i64, i, p, p, i64, i64, i64, f]
    for fn in (lib.add_rms_norm_f32, lib.add_rms_norm_bf16):
        fn.restype, fn.argtypes = None, [i64, i, p, i64, p, i64, p, f, p, i64, p, i64]
    for fn in (lib.silu_mul_f32, lib.silu_mul_bf16):
        fn.restype, fn.argtypes = None, [i64, i64, p, p]
    layer_args = [ctypes.POINTER(LayerCall), i64, *[ctypes.POINTER(ProductArgs)] * 4, p, p, p, p]
    lib.product_tiles.restype, lib.product_tiles.argtypes = i, []
    if lib.product_tiles():
        lib.pack_bf16.restype, lib.pack_bf16.argtypes = None, [i64, i64, p, p]
        lib.product_bf16.restype, lib.product_bf16.argtypes = None, [i64, i64, i64, p, i64, p, p, p, i64]
        lib.layer_bf16.restype, lib.layer_bf16.argtypes = None, layer_args
    lib.product_f32_cols.restype, lib.product_f32_cols.argtypes = i, []
    if lib.product_f32_cols():
        lib.pack_f32.restype, lib.pack_f32.argtypes = None, [i64, i64, p, p]
        lib.product_f32.restype, lib.product_f32.argtypes = None, [i64, i64, i64, p, i64, p, p, p, i64]
        lib.layer_f32.restype, lib.layer_f32.argtypes = None, layer_args
    return lib


def build_id() -> str:
    """Which build of the kernels this host runs (what timings of them depend on)."""
    cc = compiler()
    return library_path(cc).stem if cc else "none"


def available() -> bool:
    return library() is not None


def products_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this host's build has the ``dtype`` product (bf16 needs 512-bit vectors, fp32 AVX2)."""
    return product_cols(dtype) > 0


def product_cols(dtype: torch.dtype) -> int:
    """How many outputs a group of the ``dtype`` product's blocked layout holds (0: no such product here)."""
    lib = library()
    if lib is None:
        return 0
    return {torch.bfloat16: lambda: 16 * lib.product_tiles(), torch.float32: lib.product_f32_cols}.get(
        dtype, lambda: 0)()


def loaded() -> ctypes.CDLL:
    """The library, or a clear error where this host has none."""
    lib = library()
    if lib is None:
        raise RuntimeError("the batch-invariant kernels are not available on this host (no C compiler?)")
    return lib


def by_dtype(kernel: str, dtype: torch.dtype):
    """The ``kernel``'s build for ``dtype`` (``attend_f32``, ``rope_attend_bf16``, ``layer_f32``, ...)."""
    suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype)
    if suffix is None:
        raise TypeError(f"the batch-invariant kernels take fp32 or bf16, not {dtype}")
    return getattr(loaded(), f"{kernel}_{suffix}")


def checked(capacity: int, visible: torch.Tensor, slots: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The visibility as contiguous booleans and the write slots as contiguous int64, refused
    where they reach past an arena of ``capacity`` slots (the kernels read and write there
    unchecked)."""
    if visible.dtype != torch.bool or not visible.is_contiguous():
        visible = visible.bool().contiguous()
    if visible.shape[-1] > capacity:
        raise ValueError(f"visibility over {visible.shape[-1]} slots, but the arena holds {capacity}")
    if slots is not None:
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        if int(slots.max()) >= capacity:
            raise ValueError(f"a key for slot {int(slots.max())}, but the arena holds {capacity}")
    return visible, slots


def arena_args(keys: list[torch.Tensor], values: list[torch.Tensor], visible: torch.Tensor,
               slots: torch.Tensor | None = None) -> tuple:
    """What the attention kernels take of the arena and the mask: per batch row where its keys and
    values start, the arena's KV-head and slot strides, and the visibility with its strides and
    width; then the visibility and the slots as ``checked`` returns them (to keep alive through
    the call)."""
    k0 = keys[0]
    visible, slots = checked(k0.shape[1], visible, slots)
    rows = ctypes.c_int64 * len(keys)
    return (rows(*(k.data_ptr() for k in keys)), rows(*(v.data_ptr() for v in values)), k0.stride(0), k0.stride(1),
            visible.data_ptr(), visible.stride(0), visible.stride(1), visible.shape[-1]), visible, slots


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
           visible: torch.Tensor) -> torch.Tensor:
    """Batch-invariant attention with grouped KV heads.

    q: [B, Hq, T, hd], the head dim contiguous; keys, values: per batch row its arena row
    [Hkv, capacity, hd] (contiguous), slots beyond ``visible``'s width never read;
    visible: [B, T, S] boolean. Returns [B, Hq, T, hd] in q's dtype, a view whose
    ``transpose(1, 2)`` is contiguous ([B, T, Hq, hd]). Every row must see at least one slot.
    """
    fn = by_dtype("attend", q.dtype)
    b, hq, t, hd = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    args, visible, _ = arena_args(keys, values, visible)  # the checked mask stays alive through the call
    out = torch.empty(b, t, hq, hd, dtype=q.dtype)
    fn(b, t, hq, keys[0].shape[0], hd, q.data_ptr(), q.stride(0), q.stride(2), q.stride(1), *args,
       out.data_ptr(), out.stride(0), out.stride(1), out.stride(2), hd ** -0.5)
    return out.transpose(1, 2)


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                visible: torch.Tensor) -> torch.Tensor:
    """Rotary on the new queries and keys, the new keys and values into the arena, then
    ``attend``, in one call (rounded as torch's ops in q's dtype round them).

    q: [B, Hq, T, hd]; k, v: [B, Hkv, T, hd] (views with the head dim contiguous); cos, sin:
    [B, 1, T, hd], sin with its first half negated (``layers.signed_sin``); slots: [B, T], where
    each token's key and value go in its batch row's arena row (``keys``, ``values``: per batch
    row, [Hkv, capacity, hd]); visible: [B, T, S] boolean. Returns [B, Hq, T, hd] as ``attend``."""
    fn = by_dtype("rope_attend", q.dtype)
    b, hq, t, hd = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_attend needs the head dim contiguous")
    args, visible, slots = arena_args(keys, values, visible, slots)  # checked, alive through the call
    buf = torch.empty(2, b, t, hq, hd, dtype=q.dtype)  # the rotated queries, then the output
    rotated, out = buf.data_ptr(), buf.data_ptr() + buf.stride(0) * buf.element_size()
    fn(b, t, hq, keys[0].shape[0], hd, q.data_ptr(), q.stride(0), q.stride(2), q.stride(1),
       k.data_ptr(), k.stride(0), k.stride(2), k.stride(1), v.data_ptr(), v.stride(0), v.stride(2), v.stride(1),
       cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.stride(2), slots.data_ptr(), slots.stride(0), *args,
       rotated, out, t * hq * hd, hq * hd, hd, hd ** -0.5)
    return buf[1].transpose(1, 2)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``s = x + y`` (``x`` alone when y is None) and its RMSNorm
    ``weight * norm(s)`` in one call row by row, in x's dtype (bf16 rounded as torch's bf16 ops
    round them). x, y: [..., D] fp32 or bf16, contiguous; weight: [D] alike. Returns (s, normed)."""
    fn = by_dtype("add_rms_norm", x.dtype)
    if not x.is_contiguous() or y is not None and not y.is_contiguous():
        raise ValueError("add_rms_norm takes contiguous rows")
    d = x.shape[-1]
    rows = x.numel() // d
    out = torch.empty((2, *x.shape), dtype=x.dtype)  # the sum, then its norm
    at = out.data_ptr()
    fn(rows, d, x.data_ptr(), d, None if y is None else y.data_ptr(), d, weight.data_ptr(), eps,
       at, d, at + rows * d * out.element_size(), d)
    return out.unbind(0)


class ProductArgs(ctypes.Structure):
    """A packed weight as ``layer_bf16`` and ``layer_f32`` take it."""

    _fields_ = [("w", ctypes.c_void_p), ("b", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class AttentionGroup(ctypes.Structure):
    """One attention call of a layer (``layer_bf16``, ``layer_f32``): B batch rows of T tokens at rows
    [row0, row0 + B·T) of the call, each with its arena row per layer (``kv``: [layers, 2, B]
    addresses, keys then values; the arena's KV-head and slot strides), slots [B, T], mask
    [B, T, S] and rotary tables [B, T, hd]."""

    _fields_ = [(name, ctypes.c_int64) for name in ("B", "T", "S", "row0")] + [
        ("slots", ctypes.c_void_p), ("ssb", ctypes.c_int64), ("kv", ctypes.c_void_p), ("ksh", ctypes.c_int64),
        ("kss", ctypes.c_int64),
        ("mask", ctypes.c_void_p), ("msb", ctypes.c_int64), ("mst", ctypes.c_int64),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("csb", ctypes.c_int64), ("cst", ctypes.c_int64)]


class LayerCall(ctypes.Structure):
    """What every layer of one forward shares (``layer_bf16``, ``layer_f32``): shapes, the
    attention groups and scratch buffers (in the layer's dtype)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "H", "Hq", "Hkv", "hd", "I", "ngroups")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("groups", ctypes.POINTER(AttentionGroup))] + [
        (name, ctypes.c_void_p) for name in ("qkv", "qbuf", "attn", "proj", "gu", "act")]


@dataclass(frozen=True)
class BlockedWeight:
    """A weight [N, K] in ``product``'s blocked layout for its dtype, with its bias as fp32 (or None)."""

    weight: torch.Tensor  # [groups · cols · K], the weight's dtype
    bias: torch.Tensor | None  # [groups · cols] fp32, zero past N
    out_features: int
    in_features: int

    @property
    def args(self) -> ProductArgs:
        return ProductArgs(self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
                           self.out_features, self.in_features)


# dtype -> (its packing, its product)
_PRODUCTS = {torch.bfloat16: ("pack_bf16", "product_bf16"), torch.float32: ("pack_f32", "product_f32")}


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockedWeight:
    """``weight`` [N, K] (bf16 with K even, or fp32) and its bias laid out for ``product``: a
    copy as large as the weight, padded to whole groups of columns."""
    lib = loaded()
    n, k = weight.shape
    if weight.dtype not in _PRODUCTS or weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"the products take bf16 weights with an even input width or fp32 weights, "
                         f"not {weight.dtype} [{n}, {k}]")
    cols = product_cols(weight.dtype)
    if not cols:
        needs = "512-bit vectors" if weight.dtype == torch.bfloat16 else "AVX2 and FMA"
        raise RuntimeError(f"this host's build of the kernels has no {weight.dtype} product (it needs {needs})")
    groups = -(-n // cols)
    weight = weight.detach().contiguous()
    blocked = torch.empty(groups * cols * k, dtype=weight.dtype)
    getattr(lib, _PRODUCTS[weight.dtype][0])(n, k, weight.data_ptr(), blocked.data_ptr())
    padded = None
    if bias is not None:
        padded = torch.zeros(groups * cols, dtype=torch.float32)
        padded[:n] = bias.detach().float()
    return BlockedWeight(blocked, padded, n, k)


def product(x: torch.Tensor, w: BlockedWeight) -> torch.Tensor:  # [M, K] -> [M, N]
    """``x @ Wᵀ + bias`` in the weight's dtype with fp32 accumulation, every row's numbers
    independent of the others' (x: rows in that dtype, the last dim contiguous)."""
    dtype = w.weight.dtype
    if x.dtype != dtype or x.shape[-1] != w.in_features:
        raise ValueError(f"this product takes {dtype} rows of {w.in_features}, not {x.dtype} {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=dtype)
    getattr(library(), _PRODUCTS[dtype][1])(m, w.out_features, w.in_features, x.data_ptr(), x.stride(0),
                                            w.weight.data_ptr(), None if w.bias is None else w.bias.data_ptr(),
                                            y.data_ptr(), w.out_features)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2·I] -> [M, I]
    """``silu(gate) * up`` of rows holding gate then up (fp32, or bf16 rounded as torch's bf16
    ops round them): what the one-call layers compute between their MLP products."""
    fn = by_dtype("silu_mul", gate_up.dtype)
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul takes contiguous rows")
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    fn(m, width // 2, gate_up.data_ptr(), out.data_ptr())
    return out
