"""A method as a launch holds it: the runtime, the per-request policy its declaration builds,
and what it keeps across requests. Every method decodes through the one round loop, alone
(``decode``) or as one request of a batch (``stream``, ``spec/loop.Batch``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from infer.pricing.budget import NodeBudget
from infer.rounds import loop
from infer.rounds.decoding import Decoded, DecodeOptions, Runtime
from schemafill.contract.toolcall import ToolRequest


@dataclass(frozen=True)
class Method:
    rt: Runtime
    drafting: Callable[..., loop.Drafting]  # (request, prompt, **hints) -> this request's policy
    budget: NodeBudget | None = None  # its pricing, reported in metrics.json
    memory: Any = None  # what it learns across requests (``reset()``), or None

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions(),
               **hints: Any) -> Decoded:
        """``hints`` reach the method's policy (SchemaFill's given forecast and values)."""
        return loop.decode(self.runtime(request), prompt, options, self.drafting(request, prompt, **hints))

    def stream(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions(),
               **hints: Any) -> loop.Stream:
        """The request as one member of a ``loop.Batch`` (its KV arena is allocated now)."""
        return loop.Stream(self.runtime(request), prompt, options, self.drafting(request, prompt, **hints))

    def runtime(self, request: ToolRequest) -> Runtime:
        """The launch's runtime, writing this request's answer in its own format (a structured
        output's object, ``ToolRequest.response_format``)."""
        fmt = request.response_format(self.rt.fmt)
        return self.rt if fmt is self.rt.fmt else replace(self.rt, fmt=fmt)

    def reset(self) -> None:
        """Forget what was learnt from earlier requests (a launch's measured pass starts here)."""
        if self.memory is not None:
            self.memory.reset()
