"""The decoder interface: what every method is given per request, and what it returns.

Every decoder is an object with ``decode(request, prompt, options) -> Decoded``, built once
per launch from a ``DecoderContext`` by its module's ``build(ctx, method)``, which the
registry in ``infer/decoders`` names. Every one but Parallel Fill is lossless at
temperature 0 (DESIGN §3): its tokens equal AR's. Decoders that learn from earlier
requests of a launch also have ``reset()`` (``infer.decoders.reset``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from infer.constraint import Constraint
from infer.sampling import Sampler
from schemafill.config import DecodeConfig
from schemafill.runtime import Target
from schemafill.toolcall import ToolRequest


@dataclass(frozen=True)
class DecodeOptions:
    """Per request: how the target's choice is made at each node."""

    sampler: Sampler | None = None  # None or temperature 0: greedy
    constraint: Constraint | None = None  # the response grammar (decode.constrain), or None


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


class Decoder(Protocol):
    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()
               ) -> Decoded: ...


@dataclass
class DecoderContext:
    """What a launch builds its decoders from: the target, its tokenizer and stop tokens, the
    decode settings, and the head (loaded on first use: AR and the training-free methods
    never need one)."""

    target: Target
    tokenizer: Any
    eos: frozenset[int]
    decode: DecodeConfig
    head_folder: str
    skeletons: dict[str, dict] = field(default_factory=dict)  # AR's outputs by request id, as AR decodes them
    _head: Any = None

    @property
    def head(self) -> Any:
        if self._head is None:
            from infer.head_drafter import load_runtime_head

            self._head = load_runtime_head(self.head_folder, self.target)
        return self._head
