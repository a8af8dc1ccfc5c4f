"""What a launch builds its decoders from (``build(ctx, method)`` in each decoder module)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel, load_or_measure
from infer.proposers.head import load_runtime_head
from infer.rounds.decoding import Runtime
from schemafill.config import DecodeConfig
from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.runtime.model import Target


@dataclass
class DecoderContext:
    """What a launch builds its decoders from: the target, its tokenizer and stop tokens, the
    decode settings, the target's response format, and the head (loaded on first use: AR and
    the training-free methods never need one)."""

    target: Target
    tokenizer: Any
    eos: frozenset[int]
    decode: DecodeConfig
    head_folder: str
    fmt: ResponseFormat = JSON
    skeletons: dict[str, dict] = field(default_factory=dict)  # AR's outputs by request id, as AR decodes them
    _head: Any = None
    _cost: Any = None

    @property
    def runtime(self) -> Runtime:
        return Runtime(self.target, self.tokenizer, self.eos, self.decode.max_new_tokens, self.fmt)

    @property
    def head(self) -> Any:
        if self._head is None:
            self._head = load_runtime_head(self.head_folder, self.target)
        return self._head

    @property
    def cost(self) -> CostModel | None:
        """The target's measured verification cost on this host (``decode.select=cost``;
        measured once per host and cached), or None for the fixed budget."""
        if self.decode.select != "cost":
            return None
        if self._cost is None:
            folder = self.decode.cost_cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
                "schemafill" / "cost"
            self._cost, fresh = load_or_measure(self.target, folder, self.decode.cost_context)
            a, b = self._cost.linear_fit()
            print(f"[infer] verification cost c(n) {'measured' if fresh else 'cached'}: {a:.1f} + {b:.2f}·n ms "
                  f"(c(1) {self._cost(1):.1f}, c(32) {self._cost(32):.1f}, c(64) {self._cost(64):.1f} ms)")
        return self._cost

    def budget(self) -> NodeBudget:
        """A fresh per-decoder node budget: cost-aware under ``decode.select=cost``."""
        return NodeBudget(self.cost, fixed_host_ms=self.decode.host_ms)
