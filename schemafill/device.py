"""Device and precision policy, one place (DESIGN §7).

CUDA in bf16 when present, CPU in fp32 otherwise, from the same code path; ``model.dtype``
can force either. bf16 on a CPU is used only where the host computes it natively: CPUs with
AVX512-BF16 or AMX do; on others (AVX2 only, or AVX-512 without BF16) it is emulated, and a
bf16 matmul costs ~30-50x its fp32 twin (measured on a 2-core AMD EPYC, AVX2: a
[1024, 576] @ [576, 1536] matmul takes 33 ms in fp32 and 1,650 ms in bf16). The decision is a
pure function of what torch reports (``bf16_decision``), so both answers are testable on any
host; ``cpu_bf16_native`` gathers those facts for this host, honouring the variables that
make a better CPU stand in for a weaker one (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``).
"""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which it still issues native bf16 instructions
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
              "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")
SETTINGS = ("auto", "true", "false")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_bf16_native()[0]:
        warnings.warn(f"model.dtype={name} on a CPU without native bf16 ({cpu_bf16_native()[1]}): "
                      "expect it to run ~30x slower than float32", stacklevel=2)
    return dtype


def bf16_decision(setting: str, device_type: str, capability: str, avx512_bf16: bool | None, amx: bool | None,
                  onednn_isa: str | None, probe_ratio: float | None = None,
                  cuda_bf16: bool = True) -> tuple[bool, str]:
    """Whether to compute in bf16, and why (pure: every fact comes in as an argument).

    ``setting`` is auto | true | false; ``capability`` is ATen's CPU capability (AVX2,
    AVX512, ...); ``avx512_bf16`` / ``amx`` are the CPU's flags (None: torch cannot say, as
    off x86); ``onednn_isa`` the ONEDNN_MAX_CPU_ISA cap, if set; ``probe_ratio`` a measured
    bf16 / fp32 matmul time, used only where the flags cannot say.
    """
    setting = str(setting).lower()
    if setting not in SETTINGS:
        raise ValueError(f"bf16 setting must be one of {SETTINGS}, got {setting!r}")
    if device_type == "cuda":  # the setting is the CPU's: a GPU computes bf16 natively or not at all
        return cuda_bf16, "CUDA bf16" if cuda_bf16 else "this GPU has no bf16"
    if setting != "auto":
        return setting == "true", f"forced ({setting})"
    if avx512_bf16 is None and amx is None:
        if probe_ratio is None:
            return False, f"CPU {capability}: bf16 support unknown, fp32"
        native = probe_ratio <= 1.0
        return native, f"CPU {capability}: timed probe, bf16 matmul {probe_ratio:.2f}x fp32"
    flags = [name for name, has in (("AVX512-BF16", avx512_bf16), ("AMX", amx)) if has]
    if not flags:
        return False, f"CPU {capability} without AVX512-BF16 or AMX: bf16 would be emulated, fp32"
    if not capability.upper().startswith("AVX512"):
        return False, f"CPU capability capped at {capability} (ATEN_CPU_CAPABILITY): fp32"
    if onednn_isa and onednn_isa.upper() not in _BF16_ISAS:
        return False, f"oneDNN capped at {onednn_isa} (ONEDNN_MAX_CPU_ISA): fp32"
    return True, f"CPU {capability} with {' and '.join(flags)}: native bf16"


@functools.cache
def _probe_ratio() -> float:
    """bf16 / fp32 time of one mid-sized matmul on this host (measured once per process)."""
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    times = []
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            x @ y
        times.append(time.perf_counter() - t0)
    return times[1] / times[0]


@functools.cache
def cpu_bf16_native() -> tuple[bool, str]:
    """Does this host's CPU compute bf16 natively? (and why we think so)."""
    on_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    cpu = torch.cpu
    avx512_bf16 = cpu._is_avx512_bf16_supported() if on_x86 and hasattr(cpu, "_is_avx512_bf16_supported") else None
    amx = cpu._is_amx_tile_supported() if on_x86 and hasattr(cpu, "_is_amx_tile_supported") else None
    ratio = _probe_ratio() if avx512_bf16 is None and amx is None else None
    return bf16_decision("auto", "cpu", torch.backends.cpu.get_cpu_capability(), avx512_bf16, amx,
                         os.environ.get("ONEDNN_MAX_CPU_ISA"), probe_ratio=ratio)


def use_bf16(setting: str, device: torch.device) -> tuple[bool, str]:
    """The bf16 decision for ``device`` under ``setting`` (auto | true | false)."""
    if str(setting).lower() == "auto" and device.type == "cpu":
        return cpu_bf16_native()  # cached: the flags, or the timed probe, once per process
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return bf16_decision(setting, device.type, torch.backends.cpu.get_cpu_capability(), None, None,
                         os.environ.get("ONEDNN_MAX_CPU_ISA"), cuda_bf16=cuda_bf16)


def host_summary() -> dict:
    """What a measured time depends on: CPU capability, cores, threads, and the GPU if any."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_model": _cpu_model(),
            "bf16_native_cpu": cpu_bf16_native()[0], "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
