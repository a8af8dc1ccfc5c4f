"""Structured outputs (a JSON schema the answer must follow) through every method: the
object format read by the parser and the stopping rule, the schema's grammar, and SchemaFill
drafting the schema's fields as slots — lossless against constrained AR, every answer valid,
and with the right prepared values fewer target calls."""

from __future__ import annotations

import json

import pytest
import torch

from infer.decoders import slot_parallel
from infer.pricing.budget import NodeBudget
from infer.proposers.head import SCHEMAFILL_BUDGET, HeadDrafter
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.slots.policy import SchemaFillConfig
from schemafill.contract.parser import parse_prefix
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import JSON, dumps, object_format
from schemafill.contract.stopping import ResponseStop
from schemafill.contract.toolcall import InvalidRequest, ToolRequest
from schemafill.runtime.grammar import SchemaGrammars, valid_response
from tests.conftest import decode_ar, decode_tree
from tests.decoders.test_schemafill import base_target, random_head  # noqa: F401  (fixture)

BOOKING = {"type": "object", "properties": {
    "route": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
              "required": ["from", "to"]},
    "passengers": {"type": "array", "items": {"type": "string"}},
    "seats": {"type": "integer"}}, "required": ["route", "passengers", "seats"]}


def structured(text: str, schema: dict = BOOKING, strict: bool = True) -> ToolRequest:
    return ToolRequest(id="so", messages=[{"role": "user", "content": text}], tools=[],
                       output={"name": "booking", "schema": schema, "strict": strict})


def test_the_object_format_reads_an_answer_as_one_calls_arguments():
    fmt = object_format("booking")
    text = '{"route": {"from": "Lima", "to": "Quito"}, "seats": 2}'
    state = parse_prefix(text[:-1], fmt)  # inside the number
    assert (state.tool_name, state.field, state.in_value, state.fields_done) == ("booking", "seats", True, ("route",))
    assert parse_prefix(text, fmt).closed and not parse_prefix(text[:-1], fmt).closed
    assert parse_prefix("[1]", fmt).error  # a structured output is one object
    assert fmt.parse(text) == [{"name": "booking", "arguments": json.loads(text)}]
    assert fmt.serialize(fmt.parse(text)) == text and fmt.field_prefix("booking", "seats") == '{"seats":'
    record = structured("x").to_dict()
    assert ToolRequest.from_dict(record).output == record["output"]  # records keep the schema
    with pytest.raises(InvalidRequest, match="output"):
        ToolRequest.from_dict({**record, "output": {"schema": "not a schema"}})


def test_the_stopping_rule_ends_at_the_objects_close_and_at_a_stop_sequence(smol_tokenizer):
    tok = smol_tokenizer
    text = '{"seats": 2}'
    ids = tok(text + " trailing", add_special_tokens=False).input_ids
    stop = ResponseStop(tok, frozenset({tok.eos_token_id}), 64, fmt=object_format("booking"))
    stop.push(ids)
    assert stop.reason == "closed" and stop.text == text
    words = tok("The answer is here. Then more words follow.", add_special_tokens=False).input_ids
    stop = ResponseStop(tok, frozenset({tok.eos_token_id}), 64, stops=("here.",))
    taken = stop.push(words)
    assert stop.reason == "stop" and stop.text == "The answer is " and taken < len(words)
    assert tok.decode(stop.ids).endswith("here.")  # the response ends at the token completing the stop


def decode_all(target, tok, eos, req, max_new, values=None):
    """Constrained AR and every speculative method on one structured-output request."""
    grammars = SchemaGrammars(tok, target.config.vocab_size, JSON, eos)
    fmt = req.response_format(JSON)

    def constraint():
        return grammars.constraint(req.slot_functions, True, fmt=fmt)

    ids = prompt_ids(req, "plain", tok)
    ar = decode_ar(target, tok, ids, max_new, eos, constraint=constraint(), fmt=fmt)
    head = random_head(target)
    eagle = decode_tree(target, tok, ids, max_new, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                        scratch=SCHEMAFILL_BUDGET.total, constraint=constraint(), fmt=fmt)
    sf = slot_parallel.declare(Runtime(target, tok, eos, max_new), head,
                               SchemaFillConfig(budget=SCHEMAFILL_BUDGET, ablation="D"))
    out = sf.decode(req, ids, DecodeOptions(constraint=constraint()), values=values)
    return ar, {"eagle3": eagle, "schemafill": out}


def test_structured_outputs_are_lossless_valid_and_drafted_as_slots(base_target):  # noqa: F811
    target, tok, eos = base_target
    req = structured("Book 2 seats from Lima to Quito for Ana and Luis.")
    ar, outs = decode_all(target, tok, eos, req, 64)
    assert ar.stop == "closed" and valid_response(ar.text, req.slot_functions, fmt=req.response_format(JSON))
    for name, out in outs.items():
        assert out.ids == ar.ids and out.stop == ar.stop, (name, ar.text, out.text)
    # the answer's own values prepared on SIDE: packed with the structure between them
    values = {(0, k): dumps(v) for k, v in json.loads(ar.text).items()}
    _, primed = decode_all(target, tok, eos, req, 64, values)
    assert primed["schemafill"].ids == ar.ids
    assert primed["schemafill"].target_calls * 2 <= ar.target_calls, (primed["schemafill"].target_calls,
                                                                      ar.target_calls)


def test_values_are_copied_from_the_request_by_their_text(base_target):  # noqa: F811
    """A string value's words follow a quote, the request's a space: other tokens, which the
    text copies find where token copies cannot ("Spr" -> "ingfield" from " Springfield")."""
    target, tok, eos = base_target
    req = structured("route: from Springfield to Riverside; passengers: Alexander Hamilton, Eliza Schuyler; seats: 2")
    grammars = SchemaGrammars(tok, target.config.vocab_size, JSON, eos)
    fmt = req.response_format(JSON)
    ids = prompt_ids(req, "plain", tok)
    ar = decode_ar(target, tok, ids, 64, eos, constraint=grammars.constraint(req.slot_functions, True, fmt=fmt),
                   fmt=fmt)
    assert "Springfield" in ar.text and "Hamilton" in ar.text  # the values it copies
    budget = NodeBudget()  # no SIDE branches (stage B): MAIN's own proposals only
    sf = slot_parallel.declare(Runtime(target, tok, eos, 64), random_head(target),
                               SchemaFillConfig(budget=SCHEMAFILL_BUDGET, ablation="B"), budget)
    out = sf.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.slot_functions, True, fmt=fmt)))
    assert out.ids == ar.ids
    copied = sum(n for source, n in budget.stats.accepted.items() if source.startswith("copy_text"))
    assert copied >= 4, budget.stats.table()


def test_values_guessed_from_the_request_are_lossless_and_save_calls(base_target):  # noqa: F811
    """Numbers the request holds, guessed at a number value's start, and strings copied from
    the request closed where their words end: the chains through them run on to the next
    value, so the rounds that write a value's first digit or last word do not end there."""
    target, tok, eos = base_target
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"},
                                               "guests": {"type": "integer"}}, "required": ["city", "nights", "guests"]}
    req = structured("Book a hotel in Springfield for 3 nights and 2 guests: city, nights, guests.", schema)
    grammars = SchemaGrammars(tok, target.config.vocab_size, JSON, eos)
    fmt = req.response_format(JSON)
    ids = prompt_ids(req, "plain", tok)

    def constraint():
        return grammars.constraint(req.slot_functions, True, fmt=fmt)

    ar = decode_ar(target, tok, ids, 48, eos, constraint=constraint(), fmt=fmt)
    assert '"Springfield"' in ar.text and ": 3" in ar.text, ar.text  # the values it copies
    calls, accepted = {}, {}
    for guesses in (0, 3):
        budget = NodeBudget()  # every drafted node verified: the guesses' chains are what differs
        sf = slot_parallel.declare(Runtime(target, tok, eos, 48), random_head(target),
                                   SchemaFillConfig(budget=SCHEMAFILL_BUDGET, ablation="B", value_guesses=guesses),
                                   budget)
        out = sf.decode(req, ids, DecodeOptions(constraint=constraint()))
        assert out.ids == ar.ids, (guesses, out.text, ar.text)
        calls[guesses] = out.target_calls
        accepted[guesses] = {s.split(":")[0] for s, n in budget.stats.accepted.items() if n}
    assert {"guess1", "guess1_end"} <= accepted[3] and not any(s.startswith("guess") for s in accepted[0])
    assert calls[3] < calls[0], calls
