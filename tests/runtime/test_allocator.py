"""The allocator policy: a user's own allocator settings win, and on glibc it applies."""

import ctypes.util
import os
import subprocess
import sys

import pytest

from schemafill.runtime.allocator import user_choice


def test_user_settings_win():
    assert user_choice({}) is None
    assert user_choice({"PATH": "/bin", "MALLOC_ARENA": "x"}) is None  # not a glibc tunable (no trailing _)
    assert "MALLOC_MMAP_THRESHOLD_" in user_choice({"MALLOC_MMAP_THRESHOLD_": "1"})
    assert "GLIBC_TUNABLES" in user_choice({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert user_choice({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) is None
    assert user_choice({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}) == "tcmalloc preloaded"


MAPPED = """
import ctypes, ctypes.util, torch
from schemafill.runtime.allocator import retain_freed_memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
said = retain_freed_memory()
before = libc.mallinfo2().hblkhd
x = torch.ones(6 << 20)  # 24 MB, a prefill layer's MLP activation
print(said, libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(sys.platform != "linux" or ctypes.util.find_library("c") is None, reason="glibc only")
def test_large_blocks_come_from_the_heap():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    done = subprocess.run([sys.executable, "-c", MAPPED], capture_output=True, text=True, env=env)
    if "mallinfo2" in done.stderr:
        pytest.skip("glibc older than 2.33")
    said, mapped = done.stdout.strip().rsplit(" ", 1)
    assert said == "large blocks reuse the heap (glibc mallopt)", done.stderr
    assert int(mapped) == 0  # no fresh mapping: freed, it stays for the next layer
