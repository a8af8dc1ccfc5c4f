"""Device and precision policy, one place (docs/design.md, "Hardware awareness").

CUDA in bf16 when present, a CPU otherwise, from the same code path. On a CPU ``model.dtype:
auto`` generates training data in whichever of fp32 and bf16 a timed probe of the target's own
shapes finds faster (``schemafill/precision.py``: never by CPU flags, which mean opposite things
on different hosts) and verifies drafts in fp32 (``schemafill.runtime.loading.decode_choice``);
``model.dtype`` can force either.
"""

from __future__ import annotations

import torch

from schemafill.runtime.precision import Precision, Shape, decide

DECODE_ROWS = 16  # a verification's rows in the decode probe (beside one AR row)
TRAIN_PROBE_ROWS = 1024  # rows of the train probe's step: a few seconds, the shape of a training step
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` on ``device`` without a probe: an explicit dtype as named; ``auto`` bf16 on
    CUDA, fp32 on a CPU (``schemafill.runtime.loading.decode_choice`` probes a target's own shapes)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def decode_precision(device: torch.device, config) -> Precision:
    """What ``model.dtype: auto`` decodes in for a target with this Hugging Face ``config``, and why."""
    return decide("auto", "decode", device, Shape.of(config, DECODE_ROWS))


def train_precision(setting: str, device: torch.device, config, tokens: int) -> Precision:
    """Whether a fine-tune of a model with ``config`` autocasts to bf16 (``setting``: auto | true |
    false), and why: on a CPU, the train probe's choice at ``tokens`` rows a step."""
    return decide(setting, "train", device, Shape.of(config, tokens))
