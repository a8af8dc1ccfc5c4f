"""Precision by measurement: the choice on injected timings (both answers, any CPU), the cache
that keeps a host's probe, forced settings, and this host's real probe standing in for an
AVX2-only one."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from schemafill.runtime.precision import Shape, choose, decide, host_key, probe
from tests.conftest import ROOT

SMALL = Shape(hidden=64, intermediate=128, kv_hidden=32, vocab=512, rows=32)


@pytest.mark.parametrize("fp32_ms,bf16_ms,bf16", [
    (431.0, 658.0, False),  # AVX512-BF16 without AMX: bf16 1.5x slower
    (10.8, 2.0, True),  # a host that computes bf16 natively and fast (AMX-class): bf16 5x faster
    (33.0, 1650.0, False),  # AVX2 only: bf16 emulated
    (100.0, 95.0, False),  # within the margin: not worth bf16's precision
    (100.0, 89.0, True),
])
def test_the_faster_precision_is_chosen(fp32_ms, bf16_ms, bf16):
    chosen, why = choose(fp32_ms, bf16_ms)
    assert chosen is bf16 and f"{bf16_ms:.1f} ms" in why and f"{fp32_ms:.1f} ms" in why


def test_a_cached_probe_decides_without_measuring_and_forced_settings_win(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr("schemafill.runtime.precision.probe", lambda kind, shape: pytest.fail("probed despite the cache"))
    for fp32_ms, bf16_ms, bf16 in ((10.8, 2.0, True), (8.7, 12.6, False)):
        for kind in ("train", "decode"):
            path = tmp_path / kind
            key = host_key(kind, SMALL)
            path.mkdir(exist_ok=True)
            (path / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json").write_text(
                json.dumps({"key": key, "fp32_ms": fp32_ms, "bf16_ms": bf16_ms}))
            chosen = decide("auto", kind, cpu, SMALL, path)
            assert chosen.bf16 is bf16 and chosen.cached and (chosen.fp32_ms, chosen.bf16_ms) == (fp32_ms, bf16_ms)
            assert chosen.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert decide("true", "train", cpu, SMALL, tmp_path).bf16 is True
    assert decide("False", "train", cpu, SMALL, tmp_path).bf16 is False  # OmegaConf writes bools as str
    with pytest.raises(ValueError, match="auto"):
        decide("maybe", "train", cpu, SMALL, tmp_path)


def test_verifying_work_keeps_fp32_where_the_probe_prefers_bf16(tmp_path, monkeypatch, tiny_target):
    """Generating data takes the probe's bf16; verifying drafts stays fp32 (bf16's n-row and
    one-row forwards round differently, so speculation would drift from AR); a forced dtype wins."""
    from schemafill.config import ModelConfig
    from schemafill.runtime.backends.batch_invariant import possible
    from schemafill.runtime.device import DECODE_ROWS
    from schemafill.runtime.kernels import batch_invariant as kernels
    from schemafill.runtime.loading import decode_choice, load_config
    from schemafill.runtime.precision import default_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu, auto = torch.device("cpu"), ModelConfig(name="t", source="t", aux_layer_ids=[1], dtype="auto")
    key = host_key("decode", Shape.of(load_config(str(tiny_target)), DECODE_ROWS))
    path = default_cache() / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "fp32_ms": 22.3, "bf16_ms": 7.8}))
    generates, why = decode_choice(auto, str(tiny_target), cpu, verifies=False)
    assert generates == torch.bfloat16 and why["bf16_ms"] == 7.8
    verifies, why = decode_choice(auto, str(tiny_target), cpu, verifies=True)
    assert why["bf16_ms"] == 7.8
    if possible(torch.bfloat16):  # bf16 rows are the same bits in AR and in a verification here
        assert verifies == torch.bfloat16 and "batch-invariant" in why["why"]
    else:
        assert verifies == torch.float32 and "lossless" in why["why"]
    monkeypatch.setattr(kernels, "library", lambda: None)  # a host without a C compiler
    verifies, why = decode_choice(auto, str(tiny_target), cpu, verifies=True)
    assert verifies == torch.float32 and "lossless" in why["why"]
    forced, _ = decode_choice(ModelConfig(name="t", source="t", aux_layer_ids=[1], dtype="bfloat16"), str(tiny_target), cpu, verifies=True)
    assert forced == torch.bfloat16


def test_a_probe_measures_once_then_reads_its_cache(tmp_path):
    cpu = torch.device("cpu")
    first = decide("auto", "decode", cpu, SMALL, tmp_path)
    assert not first.cached and first.fp32_ms > 0 and first.bf16_ms > 0 and "timed probe" in first.why
    again = decide("auto", "decode", cpu, SMALL, tmp_path)
    assert again.cached and (again.fp32_ms, again.bf16_ms, again.bf16) == (first.fp32_ms, first.bf16_ms, first.bf16)
    assert all(t > 0 for t in probe("train", SMALL, repeats=1))
    cfg = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          vocab_size=49152)
    assert Shape.of(cfg, 16) == Shape(576, 1536, 192, 49152, 16)  # the built-in target's layer


def test_this_host_standing_in_for_an_avx2_one_measures_fp32_faster(tmp_path):
    """Capped to AVX2, torch emulates bf16: the probe (not a flag) finds fp32 faster."""
    code = ("import torch; from pathlib import Path; from schemafill.runtime.precision import Shape, decide; "
            "p = decide('auto', 'train', torch.device('cpu'), Shape(576, 1536, 192, 49152, 256), Path(%r)); "
            "print(p.bf16, p.fp32_ms, p.bf16_ms)" % str(tmp_path))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    bf16, fp32_ms, bf16_ms = out.stdout.split()
    assert bf16 == "False" and float(bf16_ms) > float(fp32_ms), out.stdout
