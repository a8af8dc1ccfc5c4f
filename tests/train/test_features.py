"""The feature cache: runtime features with shared prefixes equal transformers' per-row
features where the loss reads them, and an interrupted build resumes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from schemafill.runtime.feature_cache import FeatureCache
from schemafill.runtime.loading import from_hf_model
from tests.conftest import tiny_llama
from train.features import target_features

AUX = [0, 1, 1]


def rows_and_starts():
    rng = random.Random(0)
    stem = [rng.randrange(300) for _ in range(9)]
    rows = [stem + [rng.randrange(300) for _ in range(n)] for n in (6, 3, 8)]
    rows += [[rng.randrange(300) for _ in range(7)], list(rows[0])]  # an unrelated row and a duplicate
    starts = [9, 10, 11, 4, 9]
    return rows, starts


def check(cache, model, rows, starts):
    for i, (row, start) in enumerate(zip(rows, starts)):
        ids = torch.tensor([row])
        ref = target_features(model, ids, torch.ones_like(ids), AUX)
        o = cache.offsets[i]
        got = lambda m: torch.from_numpy(np.asarray(m[o:o + len(row)], dtype=np.float32))  # noqa: E731
        assert torch.allclose(got(cache.aux), ref.aux[0], atol=2e-3)  # fp16 storage
        assert torch.allclose(got(cache.final)[start:], ref.final[0, start:], atol=2e-3)
        assert cache.argmax[o + start:o + len(row)].tolist() == ref.argmax[0, start:].tolist()


def test_cached_features_equal_transformers(tmp_path):
    model = tiny_llama(vocab_size=300, seed=2)
    rows, starts = rows_and_starts()
    cache = FeatureCache.build(tmp_path / "f", from_hf_model(model, AUX), rows, starts)
    check(cache, model, rows, starts)


def test_interrupted_build_resumes(tmp_path):
    model = tiny_llama(vocab_size=300, seed=2)
    target = from_hf_model(model, AUX)
    rows, starts = rows_and_starts()
    calls = {"n": 0}
    forward = target.forward

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    target.forward = dying
    with pytest.raises(KeyboardInterrupt):
        FeatureCache.build(tmp_path / "f", target, rows, starts, save_every=1)
    assert not FeatureCache.exists(tmp_path / "f")
    target.forward = forward
    calls["n"] = 0
    target.forward = lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), forward(*a, **k))[1]
    cache = FeatureCache.build(tmp_path / "f", target, rows, starts, save_every=1)
    assert calls["n"] == len(rows) - 3  # only the rows not done before the interruption
    check(cache, model, rows, starts)
