"""A request's decoding options, decided in one place for every caller (a launch of
``infer/run.py``, the server): its length cap, its grammar, and how each node is chosen.

The cap is the request's own (``max_tokens``), else the launch's ``decode.max_new_tokens``;
the grammar's closing rule starts ``decode.close_margin`` tokens before that cap, so a
request with a short cap still closes its response in time. A request that requires a call
(``tool_choice`` required or named) decodes under the grammar of the allowed tools, which
always calls one, and a structured output decodes under its schema's grammar; otherwise
``decode.constrain`` decides (``schema`` enforces the catalog's grammar, ``prune`` only
drops drafts it forbids, ``none`` neither).
"""

from __future__ import annotations

from typing import Any, Callable

from infer.rounds.decoding import DecodeOptions
from infer.rounds.sampling import Sampler
from schemafill.config import DecodeConfig
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.grammar import SchemaGrammars


def request_options(decode: DecodeConfig, grammars: Callable[[], SchemaGrammars], functions: list[dict], *,
                    seed: int, sampling: dict[str, Any] | None = None, max_tokens: int | None = None,
                    required: list[dict] | None = None, request: ToolRequest | None = None,
                    stops: tuple[str, ...] = (), logprobs: int | None = None) -> DecodeOptions:
    """``functions``: the catalog the response may call (empty: no grammar unless
    ``required``); ``required``: the tools one of which the response must call, or None;
    ``request``: the request, whose structured output (if it asks for one) always follows its
    schema — or, beside tools it may call, either calls them or follows it;
    ``grammars``: the launch's compiled grammars, built on first need. ``sampling``: the
    request's ``SamplingParams`` fields; temperature and top_p it leaves out are the launch's."""
    cap = max_tokens or decode.max_new_tokens
    close_at = cap - decode.close_margin if decode.close_margin else None
    constraint = None
    output = request.output_function if request is not None else None
    if required is not None:  # a call it must be, whatever else the request names
        constraint = grammars().constraint(required, True, min_calls=1, close_at=close_at)
    elif output is not None and request.object_only:
        fmt = request.response_format(grammars().fmt)
        constraint = grammars().constraint([output], True, close_at=close_at, fmt=fmt)
    elif output is not None:  # calls of the tools (one at least), or the output's object
        constraint = grammars().constraint(functions or request.functions, True, min_calls=1, close_at=close_at,
                                           alternative=output)
    elif functions and decode.constrain != "none":
        constraint = grammars().constraint(functions, decode.constrain == "schema", close_at=close_at)
    params = {"temperature": decode.temperature, "top_p": decode.top_p, **(sampling or {})}
    return DecodeOptions(Sampler(seed=seed, **params), constraint, cap, stops=tuple(stops), logprobs=logprobs)
