"""Precision by capability: the bf16 decision on literal hosts (both answers, any CPU), and
this host's answer under the variables that make a better CPU stand in for an AVX2 one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from schemafill.device import bf16_decision
from tests.conftest import ROOT


@pytest.mark.parametrize("capability,avx512_bf16,amx,isa,native", [
    ("AVX2", False, False, None, False),  # an AVX2-only host: emulated bf16
    ("AVX512", False, False, None, False),  # AVX-512 without BF16 (Skylake-SP): still emulated
    ("AVX512", True, False, None, True),  # Cooper Lake / Zen 4
    ("AVX512", False, True, None, True),  # Sapphire Rapids' AMX
    ("AVX2", True, True, None, False),  # ATEN_CPU_CAPABILITY=avx2 on a native host
    ("AVX512", True, True, "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2 on a native host
    ("AVX512", True, True, "avx512_core_amx", True),  # a cap that keeps bf16 (case-insensitive)
])
def test_auto_follows_the_cpu(capability, avx512_bf16, amx, isa, native):
    chosen, why = bf16_decision("auto", "cpu", capability, avx512_bf16, amx, isa)
    assert chosen is native and why


def test_true_and_false_force_it_whatever_the_host():
    assert bf16_decision("true", "cpu", "AVX2", False, False, None)[0] is True
    assert bf16_decision("False", "cpu", "AVX512", True, True, None)[0] is False  # OmegaConf writes bools as str
    with pytest.raises(ValueError, match="auto"):
        bf16_decision("maybe", "cpu", "AVX2", False, False, None)


def test_cuda_and_hosts_torch_cannot_describe():
    assert bf16_decision("auto", "cuda", "AVX2", None, None, None)[0] is True
    assert bf16_decision("auto", "cuda", "AVX2", None, None, None, cuda_bf16=False)[0] is False
    # bf16_autocast_cpu is the CPU's setting: forcing it leaves a GPU as it is
    assert bf16_decision("false", "cuda", "AVX2", None, None, None)[0] is True
    assert bf16_decision("true", "cuda", "AVX2", None, None, None, cuda_bf16=False)[0] is False
    # off x86 torch has no flags: a timed probe decides, and without one, fp32
    assert bf16_decision("auto", "cpu", "SVE256", None, None, None, probe_ratio=0.6)[0] is True
    assert bf16_decision("auto", "cpu", "DEFAULT", None, None, None, probe_ratio=31.0)[0] is False
    assert bf16_decision("auto", "cpu", "DEFAULT", None, None, None)[0] is False


def test_this_host_standing_in_for_an_avx2_one_chooses_fp32():
    code = ("from schemafill.device import use_bf16, resolve_device; "
            "print(use_bf16('auto', resolve_device('cpu')))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("(False,"), out.stdout
