"""The decoder interface: what every method is given per request, and what it returns.

Every decoder is an object with ``decode(request, prompt, options) -> Decoded``, built once
per launch from a ``DecoderContext`` by its module's ``build(ctx, method)``, which the
registry in ``infer/decoders`` names. Every one but Parallel Fill is lossless at
temperature 0 (DESIGN §3): its tokens equal AR's. Decoders that learn from earlier
requests of a launch also have ``reset()`` (``infer.decoders.reset``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from infer.constraint import Constraint
from infer.cost_model import CostModel, load_or_measure
from infer.node_budget import NodeBudget
from infer.sampling import Sampler
from schemafill.config import DecodeConfig
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop
from schemafill.toolcall import ToolRequest


@dataclass(frozen=True)
class DecodeOptions:
    """Per request: how the target's choice is made at each node."""

    sampler: Sampler | None = None  # None or temperature 0: greedy
    constraint: Constraint | None = None  # the response grammar (decode.constrain), or None
    max_new_tokens: int | None = None  # this request's length cap (None: the launch's decode.max_new_tokens)
    # told the committed response ids after every round (the server streams from it; an
    # exception it raises ends the decode, as a client that went away does)
    on_commit: Callable[[list[int]], None] | None = None

    def cap(self, default: int) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else default

    def response_stop(self, tokenizer: Any, eos: frozenset[int], default_cap: int,
                      fmt: ResponseFormat = JSON) -> ResponseStop:
        """The stopping rule of this request in ``fmt``: its cap (or the decoder's), telling ``on_commit``."""
        return ResponseStop(tokenizer, eos, self.cap(default_cap), self.on_commit, fmt)


@dataclass
class Decoded:
    ids: list[int]  # response tokens
    text: str
    stop: str  # closed | eos | length
    target_calls: int  # prefill counts as one
    nodes: list[int] = field(default_factory=list)  # draft nodes per verification
    init_nodes: int = 0  # tree nodes verified with the prompt (SchemaFill's initialisation)
    times: dict[str, float] = field(default_factory=dict)  # seconds by phase, where a decoder splits them
    kv_rows: int = 0  # peak target KV rows holding live data (prompt, committed, tree, SIDE); 0 = not measured
    forced: int = 0  # response tokens the grammar forced (decode.constrain=schema): no target decision
    pruned: int = 0  # draft nodes the grammar ruled out before verification
    # each target call's rows and milliseconds (prefill first), and the EAGLE-3 head's forwards and
    # their milliseconds: the shapes ``infer/gpu_project.py`` replays on a device
    call_rows: list[int] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    head_forwards: int = 0
    head_ms: float = 0.0


class Decoder(Protocol):
    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()
               ) -> Decoded: ...


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
    def head(self) -> Any:
        if self._head is None:
            from infer.head_drafter import load_runtime_head

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
