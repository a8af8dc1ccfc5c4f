"""What this host is, as far as a measured time depends on it: the CPU model, the ISA torch
dispatches to (and the caps a user set on it), cores, threads, the torch build, and the memory
available now. Every probe keys its cache on ``timing_key``; every benchmark records ``summary``."""

from __future__ import annotations

import os
import platform

import torch


def proc_field(path: str, name: str) -> str | None:
    """The value of the first ``name:`` line of a ``/proc`` file, or None (no such file or line)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(name) and line[len(name):].lstrip().startswith(":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable, else the free pages; None where
    the OS says neither)."""
    kb = proc_field("/proc/meminfo", "MemAvailable")
    try:
        if kb is not None:
            return int(kb.split()[0]) * 1024
    except (ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def timing_key() -> list[str]:
    """What any timing on this host's CPU depends on beside the work itself."""
    return [cpu_model(), str(os.cpu_count()), f"threads{torch.get_num_threads()}",
            torch.backends.cpu.get_cpu_capability(), os.environ.get("ATEN_CPU_CAPABILITY", ""),
            os.environ.get("ONEDNN_MAX_CPU_ISA", ""), f"torch{torch.__version__}"]


def summary() -> dict:
    """What a measured time is recorded with: CPU capability, cores, threads, and the GPU if any."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_model": cpu_model(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
