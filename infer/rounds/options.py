"""A request's decoding options, decided in one place for every caller (a launch of
``infer/run.py``, the server): its length cap, its grammar, and how each node is chosen.

The cap is the request's own (``max_tokens``), else the launch's ``decode.max_new_tokens``;
the grammar's closing rule starts ``decode.close_margin`` tokens before that cap, so a
request with a short cap still closes its response in time. A request that requires a call
(``tool_choice`` required or named) decodes under the grammar of the allowed tools, which
always calls one; otherwise ``decode.constrain`` decides (``schema`` enforces the catalog's
grammar, ``prune`` only drops drafts it forbids, ``none`` neither).
"""

from __future__ import annotations

from typing import Callable

from infer.rounds.constraint import SchemaGrammars
from infer.rounds.decoding import DecodeOptions
from infer.rounds.sampling import Sampler
from schemafill.config import DecodeConfig


def request_options(decode: DecodeConfig, grammars: Callable[[], SchemaGrammars], functions: list[dict], *,
                    seed: int, temperature: float | None = None, top_p: float | None = None,
                    max_tokens: int | None = None, required: list[dict] | None = None) -> DecodeOptions:
    """``functions``: the catalog the response may call (empty: no grammar unless
    ``required``); ``required``: the tools one of which the response must call, or None;
    ``grammars``: the launch's compiled grammars, built on first need. Sampling settings a
    request leaves out are the launch's."""
    cap = max_tokens or decode.max_new_tokens
    close_at = cap - decode.close_margin if decode.close_margin else None
    constraint = None
    if required is not None:
        constraint = grammars().constraint(required, True, min_calls=1, close_at=close_at)
    elif functions and decode.constrain != "none":
        constraint = grammars().constraint(functions, decode.constrain == "schema", close_at=close_at)
    sampler = Sampler(decode.temperature if temperature is None else temperature,
                      decode.top_p if top_p is None else top_p, seed)
    return DecodeOptions(sampler, constraint, cap)
