"""The host allocator's policy for the runtime's large transient tensors (Linux glibc).

A prompt's prefill, or a round packing several requests' prompts, allocates and frees
activations of tens of MB in every layer. By default glibc serves blocks above an adaptive
threshold with fresh ``mmap`` mappings and hands freed heap tops back to the kernel, so each
such layer faults its activations in again: hundreds of thousands of minor page faults in one
call of a few thousand rows, several tenths of its time on a 2-core host (docs/benchmarks.md).
Raising the mmap threshold to glibc's maximum and keeping freed memory in the heap lets those
blocks be reused instead, which is why vLLM's CPU backend preloads tcmalloc. Memory stays
bounded by the largest call's working set, which the process touched anyway.

A user's own choice wins: nothing changes when ``MALLOC_*`` tunables are set or another
allocator is preloaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def user_choice(env: dict[str, str]) -> str | None:
    """What in ``env`` already decides the allocator's policy, if anything."""
    tunables = sorted(k for k in env if k.startswith("MALLOC_") and k.endswith("_"))
    if tunables or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return f"glibc tunables set ({', '.join(tunables) or 'GLIBC_TUNABLES'})"
    preload = env.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if name in preload:
            return f"{name} preloaded"
    return None


def retain_freed_memory() -> str:
    """Applies the policy to this process once it can; says what was done (a launch prints it)."""
    reason = user_choice(dict(os.environ))
    if reason is not None:
        return f"left as configured: {reason}"
    path = ctypes.util.find_library("c")
    if path is None:
        return "left as is: no C library found"
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return "left as is: not glibc"
    ok = all(libc.mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                                                    (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return "large blocks reuse the heap (glibc mallopt)" if ok else "left as is: glibc refused mallopt"
