"""A request's options, decided once for a launch and for the server: its cap (its own, else
the launch's), the grammar's closing rule relative to that cap, the grammar a required call
decodes under, and the sampling settings."""

from __future__ import annotations

import pytest

from infer.rounds.options import request_options
from schemafill.config import DecodeConfig
from schemafill.runtime.grammar import SchemaGrammars

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                                 "properties": {"city": {"type": "string"}}}}
OTHER = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}


@pytest.fixture(scope="module")
def grammars(smol_tokenizer):
    return SchemaGrammars(smol_tokenizer, len(smol_tokenizer))


def longest_minimal_call(grammars: SchemaGrammars, functions: list[dict]) -> int:
    """Tokens the closing rule keeps back for one call begun at the last moment."""
    probe = grammars.constraint(functions, close_at=1000)
    return 1000 - probe.close_at


def test_the_cap_is_the_requests_own_else_the_launchs_and_the_closing_rule_follows_it(grammars):
    d = DecodeConfig(max_new_tokens=200, close_margin=10, constrain="schema")
    back = longest_minimal_call(grammars, [WEATHER])
    launch = request_options(d, lambda: grammars, [WEATHER], seed=1)
    assert launch.max_new_tokens == 200 and launch.cap(999) == 200
    assert launch.constraint.close_at == 200 - 10 - back and launch.constraint.enforce
    own = request_options(d, lambda: grammars, [WEATHER], seed=1, max_tokens=60)
    assert own.max_new_tokens == 60 and own.constraint.close_at == 60 - 10 - back  # closes in time for its cap
    no_margin = request_options(DecodeConfig(max_new_tokens=200, close_margin=0, constrain="schema"), lambda: grammars,
                                [WEATHER], seed=1)
    assert no_margin.constraint.close_at is None


def test_the_grammar_follows_decode_constrain_and_a_required_call(grammars):
    built = []

    def lazily():
        built.append(1)
        return grammars

    free = request_options(DecodeConfig(constrain="none"), lazily, [WEATHER], seed=0)
    assert free.constraint is None and not built  # no grammar, and none compiled
    assert request_options(DecodeConfig(constrain="schema"), lazily, [], seed=0).constraint is None  # no tools
    prune = request_options(DecodeConfig(constrain="prune"), lazily, [WEATHER], seed=0)
    assert prune.constraint is not None and not prune.constraint.enforce
    # a required call: the allowed tools' grammar, enforced, whatever decode.constrain says
    required = request_options(DecodeConfig(constrain="none"), lazily, [WEATHER, OTHER], seed=0, required=[OTHER])
    assert required.constraint.enforce
    opener = grammars.tokenizer('{"tool_calls": [', add_special_tokens=False).input_ids
    required.constraint.advance(opener)
    row = required.constraint.next_allowed()
    close = grammars.tokenizer("]}", add_special_tokens=False).input_ids[0]
    assert not row[close]  # at least one call: the list may not close empty


def test_sampling_settings_a_request_leaves_out_are_the_launchs(grammars):
    d = DecodeConfig(temperature=0.7, top_p=0.9, constrain="none")
    launch = request_options(d, lambda: grammars, [], seed=3)
    assert (launch.sampler.params.temperature, launch.sampler.params.top_p) == (0.7, 0.9)
    own = request_options(d, lambda: grammars, [], seed=3, sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 4},
                          stops=("\n",), logprobs=2)
    assert own.sampler.greedy and own.sampler.params.top_p == 1.0 and own.sampler.params.top_k == 4
    assert (own.stops, own.logprobs) == (("\n",), 2)
