"""decode.constrain=schema: the response grammar's masks on literal trees, and every
speculative decoder equal to constrained AR, with outputs the grammar (and our parser) accept."""

from __future__ import annotations

import torch

from infer.constraint import SchemaGrammars, json_schema, response_schema
from infer.decoders.ar import decode_ar
from infer.decoders.eagle3 import decode_tree
from infer.decoders.schemafill import SchemaFill, SchemaFillConfig
from infer.decoders.toolspec import ToolSpec
from infer.head_drafter import SCHEMAFILL_BUDGET, HeadDrafter
from infer.tree import ROOT
from schemafill.models import load_tokenizer
from schemafill.parser import parse_prefix
from schemafill.prompt import prompt_ids
from schemafill.runtime import load_target
from schemafill.toolcall import parse_response
from tests.test_schemafill import WEATHER, random_head, request


def test_json_schema_drops_unknown_types_but_keeps_a_parameter_named_type():
    s = json_schema({"type": "object", "properties": {"type": {"type": "string"}, "x": {"type": "any"}}})
    assert s == {"type": "object", "properties": {"type": {"type": "string"}, "x": {}}}
    calls = response_schema([WEATHER["function"]])["properties"]["tool_calls"]["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "get_weather"}]


def test_masks_follow_the_tree_and_leave_forbidden_nodes_open(smol_tokenizer):
    tok = smol_tokenizer
    grammars = SchemaGrammars(tok, len(tok))
    c = grammars.constraint([WEATHER["function"]])
    legal = tok('{"tool_calls": [{"name": "', add_special_tokens=False).input_ids
    bad = tok("hello", add_special_tokens=False).input_ids[0]
    tokens = legal + [bad]
    parents = [i - 1 if i else ROOT for i in range(len(legal))] + [ROOT]  # "hello" is a sibling of "{"
    masks = c.masks(tokens, parents)
    assert masks.shape == (1 + len(tokens), len(tok))
    assert masks[0, legal[0]] and not masks[0, bad]
    assert masks[-1].all()  # a node the grammar forbids can never be accepted: no constraint below it
    after = masks[len(legal)]  # after the whole legal chain: the tool name starts
    name = tok('{"tool_calls": [{"name": "get_weather', add_special_tokens=False).input_ids[len(legal)]
    assert after[name] and not after[bad] and after.sum() < len(tok) // 100
    assert grammars.constraint([WEATHER["function"]]) is not None and len(grammars.compile_seconds) == 1  # cached
    c.advance(legal)  # the matcher's state did not move while masking
    assert c._allowed()[name]


def test_every_decoder_equals_constrained_ar_and_writes_valid_calls(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3])
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    head = random_head(target)
    sf = SchemaFill(target, tok, head, eos, 40, SchemaFillConfig(budget=SCHEMAFILL_BUDGET))
    ts = ToolSpec(target, tok, eos, 40)
    for name in ("bm25", "wrong_order", "no_params"):
        req = request(name)
        ids = prompt_ids(req, "plain", tok)
        free = decode_ar(target, tok, ids, 40, eos)
        ar = decode_ar(target, tok, ids, 40, eos, constraint=grammars.constraint(req.functions))
        assert ar.ids != free.ids  # a random model writes no tool call by itself
        state = parse_prefix(ar.text)
        assert state.error is None, ar.text  # a prefix of a response object, wherever it stopped
        if ar.stop == "closed":
            assert {c.name for c in parse_response(ar.text.strip())} <= {f["name"] for f in req.functions}
        outs = {
            "eagle3": decode_tree(target, tok, ids, 40, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                                  scratch=SCHEMAFILL_BUDGET.total, constraint=grammars.constraint(req.functions)),
            "toolspec": ts.decode(req, ids, constraint=grammars.constraint(req.functions)),
            "schemafill": sf.decode(req, ids, constraint=grammars.constraint(req.functions)),
        }
        for method, out in outs.items():
            assert out.ids == ar.ids, (name, method, ar.text, out.text)
