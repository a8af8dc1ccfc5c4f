"""Backends: what executes a target's calls. Each is one module behind the interface of
``runtime.calls.Backend`` (a batch-rows call, a packed call, the arenas its calls read), and
each is built once, when the target loads, by ``attach``: by ``model.backend`` or, under
``auto``, by what this device and dtype have and what a timed probe measures. The choice and
why are recorded (``Backend.summary``); no backend reads another's flags in its forward.

* ``eager`` — the model op by op in torch, SDPA over the arena; CPU kernels tuned by probes.
  Any device, any call; the others fall back to it for calls they do not cover.
* ``batch_invariant`` — a CPU's bf16 (or fp32) forward on our C kernels, a row's bits
  independent of its call: verification in bf16 still gives AR's tokens.
* ``compiled`` — the model's layers through ``torch.compile`` (inductor) for the decode
  loop's call shapes; a CPU without batch-invariant kernels gets it where it is faster.
* ``cuda_graphs`` — decode and verification calls replayed from bucketed CUDA graphs.

Adding a backend is adding a module here and a line in ``BUILDERS``.

May import: the model, storage, calls, kernels, products and probing of ``schemafill.runtime``; the
model and storage never import a backend (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from schemafill.config import BACKENDS
from schemafill.runtime.backends import batch_invariant, compiled, cuda_graphs, eager
from schemafill.runtime.calls import Backend
from schemafill.runtime.model import Target

# name -> how to build it for a loaded target (``why``: what the launch records)
BUILDERS: dict[str, Callable[[Target, str], Backend | None]] = {
    "eager": lambda target, why: eager.build(target, why=why),
    "batch_invariant": lambda target, why: batch_invariant.build(target, why),
    "compiled": lambda target, why: compiled.build(target, eager.build(target), why=why),
    "cuda_graphs": lambda target, why: cuda_graphs.build(target, eager.build(target), why=why),
}
SETTINGS = BACKENDS  # the config's names: "auto" and every builder's (tests/runtime/test_backends.py)


def attach(target: Target, setting: str = "auto", decodes: bool = True) -> Target:
    """``target`` with the backend ``setting`` names (``model.backend``) running its calls, or
    under ``auto``: for a target that ``decodes`` (runs the decode loop's calls), CUDA graphs on a
    GPU; a CPU's bf16 target batch-invariant where the host has the kernels; an fp32 target that
    decodes batch-invariant where the kernels have their own fp32 product and a timed probe of
    the decode loop's calls finds it about as fast as the alternative (``batch_invariant.choose``);
    otherwise eager, or compiled where the target decodes and a timed probe of the decode loop's
    calls finds it faster here (``compiled.choose``). Probes are cached per host and shape. A
    backend this host cannot run is an error naming it."""
    if setting not in SETTINGS:
        raise ValueError(f"model.backend must be one of {SETTINGS}, got {setting!r}")
    if setting != "auto":
        backend = BUILDERS[setting](target, f"model.backend={setting}")
    else:
        backend = auto(target, decodes)
    if backend is None:
        raise RuntimeError(f"model.backend={setting} cannot run this target here (said above)")
    target.backend = backend
    return target


def auto(target: Target, decodes: bool) -> Backend:
    if target.device.type == "cuda":
        if not decodes:
            return eager.build(target, why="auto: a CUDA target that generates batches")
        return cuda_graphs.build(target, eager.build(target), why="auto: a CUDA target replays its decode calls' graphs")
    if target.dtype == torch.bfloat16 and batch_invariant.possible(target.dtype):
        chosen = batch_invariant.build(target, "auto: bf16 on a CPU with the batch-invariant kernels")
        if chosen is not None:
            return chosen
    if decodes and target.dtype == torch.float32 and batch_invariant.kernels.products_available(torch.float32):
        return batch_invariant.choose(target, lambda why: eager_or_compiled(target, why, decodes))
    return eager_or_compiled(target, "auto: a CPU target without batch-invariant kernels", decodes)


def eager_or_compiled(target: Target, why: str, decodes: bool) -> Backend:
    """Eager, or compiled where the target decodes and its timed probe finds it faster."""
    plain = eager.build(target, why=why)
    return compiled.choose(target, plain) if decodes else plain
