"""The call interface of a target: what one call carries, what it returns, and what a backend
(whatever executes the forward: ``runtime/backends/``) provides.

A call takes new tokens, their positions, the arena slots they are written to, and which
slots each new token may see. New tokens are written into the arena *before* attention, so
"which arena rows and which new tokens may I see" is one boolean mask over slots; a tree is
just new tokens whose masks name their ancestors' slots. Two shapes of call:

* **batch rows** (``Backend.forward``): tokens ``[B, T]`` over the rows of one arena (AR
  steps, batched generation, a prompt's prefill);
* **packed** (``Backend.packed``): several requests' rows one after another, each request a
  ``Part`` over its own one-row arena (every round of the decode loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from schemafill.runtime.storage import KVArena


@dataclass(frozen=True)
class Part:
    """One request's rows of a packed call: rows ``[start, start + T)`` write their keys and
    values to ``slots`` of the request's own arena (row 0) and attend to its slots under
    ``visibility``; no row sees another request's."""

    arena: KVArena
    start: int
    slots: torch.Tensor  # [T]
    visibility: torch.Tensor  # [T, S]: S ≤ the arena's capacity

    @property
    def stop(self) -> int:
        return self.start + self.slots.shape[0]


@dataclass
class Forward:
    """What a call returns."""

    logits: torch.Tensor  # [B, K, V] fp32: at ``logits_at`` (all T positions when not given)
    aux: torch.Tensor  # [B, T, 3·H]: HF hidden_states[i] for i in aux_layer_ids, concatenated
    final: torch.Tensor  # [B, K, H]: the final normed hidden states the logits come from


def causal_visibility(positions: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T, width] visibility of a plain sequence stored at slot = position: a token sees
    every slot up to its own. positions: [B, T]."""
    return torch.arange(width, device=positions.device)[None, None, :] <= positions[..., None]


class Attend(Protocol):
    """One layer's attention as a backend runs it, given the new queries, keys and values before
    rotary: rotates them, writes the keys and values where its arena keeps them, attends."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        # q: [B, Hq, T, hd]; k, v: [B, Hkv, T, hd]; cos, sin: [B, 1, T, hd] -> [B, Hq, T, hd]
        ...


class Product(Protocol):
    """A projection as a backend computes it: ``linear``'s weight times ``x`` [..., In] -> [..., Out]."""

    def __call__(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor: ...


class Backend(Protocol):
    """What executes one target's calls, chosen once when the target loads
    (``runtime.backends.attach``)."""

    name: str

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        """A batch-rows call (``Target.forward``)."""
        ...

    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        """A packed call (``Target.packed``)."""
        ...

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        """An arena its calls can read (a backend may keep every arena in storage of its own)."""
        ...

    def draft_steps(self, head: nn.Module) -> "DraftSteps | None":
        """Where a draft head's steps run beside this target's calls (None: eagerly)."""
        ...

    def head_product(self, head: nn.Module) -> "Product":
        """What a draft head's projections run on when its steps run eagerly (``layers.plain``:
        ``nn.Linear``'s own)."""
        ...

    def key(self) -> str:
        """What a timing of its calls depends on beyond the target, device and host (a measured
        cost curve is cached under it)."""
        ...

    def summary(self) -> dict:
        """What a launch records of it: its name, why it was chosen, its choices and counters."""
        ...


class DraftSteps(Protocol):
    """Where an EAGLE-3 head's draft steps run when not eagerly (``runtime.drafter``)."""

    def arena(self, capacity: int) -> KVArena: ...

    def decode_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    visibility: torch.Tensor, write_slots: torch.Tensor, arena: KVArena) -> torch.Tensor | None:
        """The step's output hidden states, or None where it must run eagerly."""
        ...
