"""The decoder interface: what every method is given per request, and what it returns.

Every decoder is an object with ``decode(request, prompt, options) -> Decoded``, built once per
launch by its module's ``build(ctx, method)`` in ``infer/decoders``, over a ``Runtime`` (the
target and what a response is made of). Every one but Parallel Fill is lossless at temperature 0
(docs/design.md, "Lossless, and what a request costs"): its tokens equal AR's. Decoders that
learn from earlier requests of a launch also have ``reset()`` (``infer.decoders.reset``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from infer.rounds.sampling import Sampler
from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.stopping import Logprob, ResponseStop
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.grammar import Constraint
from schemafill.runtime.model import Target


@dataclass(frozen=True)
class Runtime:
    """What every decoder of a launch decodes with: the target, its tokenizer and stop
    tokens, the default length cap, and the target's response format."""

    target: Target
    tokenizer: Any
    eos: frozenset[int]
    max_new_tokens: int
    fmt: ResponseFormat = JSON


@dataclass(frozen=True)
class DecodeOptions:
    """Per request: how the target's choice is made at each node."""

    sampler: Sampler | None = None  # None or temperature 0: greedy
    constraint: Constraint | None = None  # the response grammar (decode.constrain), or None
    max_new_tokens: int | None = None  # this request's length cap (None: the launch's decode.max_new_tokens)
    # told the committed response ids (and their logprobs, when asked) after every round (the
    # server streams from it; an exception it raises ends the decode, as a client that went away does)
    on_commit: Callable[[list[int], list[Logprob] | None], None] | None = None
    stops: tuple[str, ...] = ()  # stop sequences: the response ends at the token completing one
    logprobs: int | None = None  # keep each token's logprob and this many top alternatives' (None: none)

    def cap(self, default: int) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else default

    def response_stop(self, tokenizer: Any, eos: frozenset[int], default_cap: int,
                      fmt: ResponseFormat = JSON) -> ResponseStop:
        """The stopping rule of this request in ``fmt``: its cap (or the decoder's), telling ``on_commit``."""
        return ResponseStop(tokenizer, eos, self.cap(default_cap), self.on_commit, fmt, self.stops,
                            self.logprobs is not None)


@dataclass
class Decoded:
    ids: list[int]  # response tokens
    text: str
    stop: str  # closed | eos | stop | length
    target_calls: int  # prefill counts as one
    nodes: list[int] = field(default_factory=list)  # draft nodes per verification
    init_nodes: int = 0  # tree nodes verified with the prompt (SchemaFill's initialisation)
    times: dict[str, float] = field(default_factory=dict)  # seconds by phase, where a decoder splits them
    kv_rows: int = 0  # peak target KV rows holding live data (prompt, committed, tree, SIDE); 0 = not measured
    forced: int = 0  # response tokens the grammar forced (decode.constrain=schema): no target decision
    pruned: int = 0  # draft nodes the grammar ruled out before verification
    # each target call's rows and milliseconds (prefill first), and the EAGLE-3 head's forwards and
    # their milliseconds: the shapes ``benchmarks/gpu_project.py`` replays on a device
    call_rows: list[int] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    head_forwards: int = 0
    head_ms: float = 0.0
    logprobs: list[Logprob] | None = None  # per response token, when the request asked (``DecodeOptions.logprobs``)


class Decoder(Protocol):
    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions()
               ) -> Decoded: ...
