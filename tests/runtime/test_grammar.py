"""decode.constrain=schema: the response grammar's masks on literal trees, and every
speculative decoder equal to constrained AR, with outputs the grammar (and our parser) accept."""

from __future__ import annotations

import pytest
import torch

from infer.decoders import ngram, slot_parallel, suffix, toolspec
from infer.proposers.head import SCHEMAFILL_BUDGET, HeadDrafter
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.rounds.tree import ROOT
from infer.slots.policy import SchemaFillConfig
from schemafill.config import NgramConfig, SuffixConfig, ToolSpecConfig
from schemafill.contract.parser import parse_prefix
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import HERMES, HERMES3, JSON, MISTRAL
from schemafill.contract.toolcall import parse_response
from schemafill.runtime.grammar import SchemaGrammars, minimal_value, response_schema, valid_response
from schemafill.runtime.loading import load_target, load_tokenizer
from tests.conftest import decode_ar, decode_tree, tiny_llama
from tests.decoders.test_schemafill import WEATHER, base_target, random_head, request  # noqa: F401 (a fixture)


def test_the_response_schema_names_each_tool():
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
    masks, ok = c.check(tokens, parents)
    assert ok == [True] * len(legal) + [False]
    assert masks.shape == (1 + len(tokens), len(tok))
    assert masks[0, legal[0]] and not masks[0, bad]
    assert masks[-1].all()  # a node the grammar forbids can never be accepted: no constraint below it
    after = masks[len(legal)]  # after the whole legal chain: the tool name starts
    name = tok('{"tool_calls": [{"name": "get_weather', add_special_tokens=False).input_ids[len(legal)]
    assert after[name] and not after[bad] and after.sum() < len(tok) // 100
    assert grammars.constraint([WEATHER["function"]]) is not None and len(grammars.compile_seconds) == 1  # cached
    c.advance(legal)  # the matcher's state did not move while masking
    assert c.next_allowed()[name] and c.count == len(legal)


def test_every_decoder_equals_constrained_ar_and_writes_valid_calls(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    head = random_head(target)
    sf = slot_parallel.declare(Runtime(target, tok, eos, 40), head, SchemaFillConfig(budget=SCHEMAFILL_BUDGET))
    ts = toolspec.declare(Runtime(target, tok, eos, 40), ToolSpecConfig())
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
            "toolspec": ts.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions))),
            "schemafill": sf.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions))),
        }
        for method, out in outs.items():
            assert out.ids == ar.ids, (name, method, ar.text, out.text)


def test_each_format_has_its_grammar_and_a_marker_token_is_that_token(smol_tokenizer, marker_tokenizer):
    """The grammar of every format on literal texts: its serialized calls pass (and, where EOS
    ends the format, EOS only after the closing tag), its reply without calls only where no
    call is required, and Mistral's marker only as its one special token."""
    fn = WEATHER["function"]
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]

    def walk(c, ids):
        return all(c.matcher.accept_token(i) for i in ids)

    for fmt, tok in ((HERMES, smol_tokenizer), (HERMES3, smol_tokenizer), (MISTRAL, marker_tokenizer)):
        grammars = SchemaGrammars(tok, len(tok), fmt=fmt)
        text = fmt.serialize(calls * 2)
        ids = tok(text, add_special_tokens=False).input_ids
        c = grammars.constraint([fn])
        assert walk(c, ids), fmt.name
        end = c.next_allowed()  # complete: EOS may end it (alone, where the text closed it)
        assert end[tok.eos_token_id] and (int(end.sum()) == 1) == fmt.self_closing, fmt.name
        c = grammars.constraint([fn])
        assert not walk(c, ids[:-2]) or not c.next_allowed()[tok.eos_token_id]  # cut short: no EOS yet
        other = JSON if fmt is not HERMES else HERMES3  # the same calls in another format's text
        assert not walk(grammars.constraint([fn]), tok(other.serialize(calls), add_special_tokens=False).input_ids)
        words = tok(fmt.empty, add_special_tokens=False).input_ids
        assert walk(grammars.constraint([fn]), words)
        assert not walk(grammars.constraint([fn], min_calls=1), words)  # tool_choice required: a call
        bad = fmt.serialize([{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}])  # not in the enum
        assert not walk(grammars.constraint([fn]), tok(bad, add_special_tokens=False).input_ids)
    marker = marker_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    spelt = smol_tokenizer("[TOOL_CALLS]", add_special_tokens=False).input_ids  # the marker as plain text
    c = SchemaGrammars(marker_tokenizer, len(marker_tokenizer), fmt=MISTRAL).constraint([fn], min_calls=1)
    row = c.next_allowed()
    assert row[marker] and int(row.sum()) == 1 and c.forced() == marker and not row[spelt[0]]
    # EOS is the way out once a hermes response may end: the closing rule picks it there
    closing = SchemaGrammars(smol_tokenizer, len(smol_tokenizer), fmt=HERMES).constraint([fn])
    closing.close_at = 0
    closing.advance(smol_tokenizer(HERMES.serialize(calls), add_special_tokens=False).input_ids)
    assert closing.forced() == smol_tokenizer.eos_token_id


@pytest.fixture(scope="module")
def marker_target(marker_tokenizer, tmp_path_factory):
    """A random model whose vocabulary holds the ``[TOOL_CALLS]`` special token."""
    folder = tmp_path_factory.mktemp("marker_target")
    tiny_llama(vocab_size=len(marker_tokenizer), seed=4, num_hidden_layers=4).save_pretrained(folder)
    marker_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", [HERMES, HERMES3, MISTRAL], ids=lambda f: f.name)
def test_every_decoder_equals_constrained_ar_in_every_format(fmt, tiny_target, marker_target):
    """Per format, the grammar holds a random model to that format's calls, and every
    speculative decoder's tokens equal constrained AR's (closing near the cap, so responses
    end inside the grammar: EOS after a tagged block, the bracket after mistral's list)."""
    folder = marker_target if fmt is MISTRAL else tiny_target
    target = load_target(folder, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(folder))
    eos = frozenset({tok.eos_token_id})
    grammars = SchemaGrammars(tok, target.config.vocab_size, fmt=fmt, stop_ids=eos)
    head = random_head(target)
    rt = Runtime(target, tok, eos, 48, fmt)
    sf = slot_parallel.declare(rt, head, SchemaFillConfig(budget=SCHEMAFILL_BUDGET))
    peers = {"toolspec": toolspec.declare(rt, ToolSpecConfig()), "ngram": ngram.declare(rt, NgramConfig()),
             "suffix": suffix.declare(rt, SuffixConfig())}
    for name in ("bm25", "no_params"):
        req = request(name)
        ids = prompt_ids(req, "plain", tok, fmt=fmt)
        ar = decode_ar(target, tok, ids, 48, eos, constraint=grammars.constraint(req.functions, close_at=48), fmt=fmt)
        assert parse_prefix(ar.text, fmt).error is None, ar.text
        if ar.stop != "length":
            assert fmt.complete(ar.text, ar.stop) and valid_response(ar.text, req.functions, fmt=fmt), ar.text
        outs = {
            "eagle3": decode_tree(target, tok, ids, 48, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                                  scratch=SCHEMAFILL_BUDGET.total, constraint=grammars.constraint(req.functions, close_at=48),
                                  fmt=fmt),
            "schemafill": sf.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions, close_at=48))),
            **{m: d.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions, close_at=48)))
               for m, d in peers.items()},
        }
        for method, out in outs.items():
            assert out.ids == ar.ids, (name, method, ar.text, out.text)
            assert out.forced == ar.forced
        # the packed text (after mistral's marker token too) is proposed and taken
        assert outs["schemafill"].target_calls < ar.target_calls and outs["toolspec"].target_calls < ar.target_calls


def closing_tokens(tok) -> torch.Tensor:
    """[3, V] closing tokens outside a string (only ']' and '}'), inside one (a '"' first), and
    the ones that move on to the next key (a ',' with ']', '}' and spaces), found by decoding
    each token, independently of the module's xgrammar-based table."""
    texts = [tok.decode([i]) for i in range(len(tok))]
    ok = [bool(s) and set(s) <= set('"]}') for s in texts]
    return torch.tensor([[o and '"' not in s for o, s in zip(ok, texts)], [o and s[:1] == '"' for o, s in zip(ok, texts)],
                         ["," in s and set(s) <= set(",]} ") for s in texts]])


def inside_string(text: str) -> bool:
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside and not escaped


def test_closing_mode_allows_only_closers_where_the_grammar_has_one(smol_tokenizer):
    tok = smol_tokenizer
    prefix = tok('{"tool_calls": [', add_special_tokens=False).input_ids
    call = tok('{"', add_special_tokens=False).input_ids[0]
    grammars = SchemaGrammars(tok, len(tok))
    late = grammars.constraint([WEATHER["function"]], close_at=0)
    late.close_at = len(prefix) + 1  # closing from the token after the next one
    late.advance(prefix)
    assert late.next_allowed()[call]  # not yet closing: a call may start
    masks, ok = late.check([call, tok("]", add_special_tokens=False).input_ids[0]], [ROOT, ROOT])
    assert ok == [True, True]
    outside, inside, _ = closing_tokens(tok)
    after_call = masks[1]  # in the key after '{"' at the closing index: no closer fits, so no restriction
    assert after_call.any() and not (after_call & inside).any()
    early = grammars.constraint([WEATHER["function"]], close_at=0)  # closing from the start
    early.advance(prefix)
    row = early.next_allowed()
    assert not row[call] and row.any() and not (row & ~outside).any()  # only "]"-like tokens: the list ends
    assert early.check([call], [ROOT])[1] == [False]  # a call start is pruned, though the grammar allows it
    into = tok('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par', add_special_tokens=False).input_ids
    early = grammars.constraint([WEATHER["function"]], close_at=0)
    early.advance(into)
    row = early.next_allowed()
    assert row.any() and not (row & ~inside).any()  # inside a string: only tokens that end it


def test_closing_mode_moves_on_where_an_object_still_needs_keys(smol_tokenizer):
    """After a number with a required key still to come, neither '}' nor more digits: only a
    ',' that ends the value (a random target otherwise writes digits up to the cap)."""
    tok = smol_tokenizer
    fn = {"name": "f", "parameters": {"type": "object", "required": ["a", "b"],
                                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
    grammars = SchemaGrammars(tok, len(tok))
    c = grammars.constraint([fn], close_at=0)
    c.advance(tok('{"tool_calls": [{"name": "f", "arguments": {"a": 5', add_special_tokens=False).input_ids)
    row = c.next_allowed()
    _, _, onward = closing_tokens(tok)
    assert row.any() and not (row & ~onward).any()
    free = SchemaGrammars(tok, len(tok)).constraint([fn])  # without the closing rule: digits may go on
    free.advance(tok('{"tool_calls": [{"name": "f", "arguments": {"a": 5', add_special_tokens=False).input_ids)
    assert free.next_allowed()[tok("5", add_special_tokens=False).input_ids[0]]


def masked_greedy(model, tok, grammar, prompt: list[int], steps: int, close_at: int) -> list[int]:
    """The reference: a full-sequence transformers forward per token, a fresh xgrammar matcher,
    closers found by decoding, string state from the decoded text; no arena, no tree, no
    forced-token shortcut."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    closers = closing_tokens(tok)
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    ids: list[int] = []
    for step in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, -1, : len(tok)].clone()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([bool(bitmask[0, i // 32] >> (i % 32) & 1) for i in range(len(tok))])
        inside = inside_string(tok.decode(ids))
        closing, onward = allowed & closers[int(inside)], allowed & closers[2]
        if step >= close_at and closing.any():
            allowed = closing
        elif step >= close_at and not inside and onward.any():
            allowed = onward
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.accept_token(t)
        ids.append(t)
    return ids


@pytest.mark.slow  # 70-115 s on 2 AVX2 cores: `make test-full`
def test_constrained_ar_equals_a_plain_masked_greedy_loop_and_forced_tokens_save_calls(smol_tokenizer, tmp_path):
    tok = smol_tokenizer
    model = tiny_llama(seed=4, num_hidden_layers=4)  # this one starts a call (seed 3 writes no call)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    target = load_target(tmp_path, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    eos = frozenset({tok.eos_token_id})
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    req = request("bm25")
    ids = prompt_ids(req, "plain", tok)
    constraint = grammars.constraint(req.functions, close_at=64)
    # closing starts earlier by the catalog's longest minimal call (book_flight's, ~25 tokens);
    # the model spells the header a character at a time (37 tokens), so that is inside the call
    assert 30 < constraint.close_at < 40
    ar = decode_ar(target, tok, ids, 64, eos, constraint=constraint)
    schema = grammars.cache[next(iter(grammars.cache))]
    assert ar.ids == masked_greedy(model, tok, schema, ids, len(ar.ids), close_at=constraint.close_at)
    assert ar.forced > 5 and ar.target_calls == len(ar.ids) - ar.forced  # a forced token needs no call
    assert ar.stop == "closed" and valid_response(ar.text, req.functions), ar.text  # closed before the cap


def test_minimal_value_is_the_shortest_the_schema_allows():
    schema = {"type": "object", "required": ["a", "b", "c", "d"], "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "c": {"type": "string", "enum": ["long", "x"]}, "d": {"type": "object", "required": ["e"],
                                                            "properties": {"e": {"type": "boolean"}}},
        "optional": {"type": "string"}}}
    assert minimal_value(schema) == {"a": "", "b": [0, 0], "c": "x", "d": {"e": False}}


def test_valid_response_checks_the_schema_not_just_json():
    fn = [WEATHER["function"]]
    good = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]}'
    assert valid_response(good, fn)
    assert not valid_response(good.replace('"C"', '"K"'), fn)  # outside the enum
    assert not valid_response(good.replace('"city": "Oslo", ', ""), fn)  # a required key missing
    assert not valid_response(good.replace("get_weather", "get_time"), fn)  # not in the catalog
    assert not valid_response(good[:-2], fn)  # unclosed


@pytest.mark.slow  # 70-115 s on 2 AVX2 cores: `make test-full`
def test_builtin_model_every_decoder_equals_constrained_ar_and_every_output_validates(base_target):
    target, tok, eos = base_target
    grammars = SchemaGrammars(tok, target.config.vocab_size)  # closing from ~token 21
    head = random_head(target)
    sf = slot_parallel.declare(Runtime(target, tok, eos, 48), head, SchemaFillConfig(budget=SCHEMAFILL_BUDGET))
    for name in ("bm25", "repeated"):
        req = request(name)
        ids = prompt_ids(req, "plain", tok)
        ar = decode_ar(target, tok, ids, 48, eos, constraint=grammars.constraint(req.functions, close_at=48))
        assert valid_response(ar.text, req.functions), ar.text
        eagle = decode_tree(target, tok, ids, 48, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                            scratch=SCHEMAFILL_BUDGET.total, constraint=grammars.constraint(req.functions, close_at=48))
        full = sf.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions, close_at=48)))
        for method, out in (("eagle3", eagle), ("schemafill", full)):
            assert out.ids == ar.ids, (name, method, ar.text, out.text)
            assert out.forced == ar.forced  # a property of the output, whoever decoded it
            assert out.pruned > 0  # the grammar ruled out some drafts before they cost a row
        assert full.target_calls < ar.target_calls
        # prune: the target stays free, the grammar only drops drafts; still free AR's tokens
        free = decode_ar(target, tok, ids, 48, eos)
        guided = {"eagle3": decode_tree(target, tok, ids, 48, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                                        scratch=SCHEMAFILL_BUDGET.total,
                                        constraint=grammars.constraint(req.functions, enforce=False, close_at=48)),
                  "schemafill": sf.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions, enforce=False, close_at=48)))}
        for method, out in guided.items():
            assert out.ids == free.ids, (name, method, free.text, out.text)
            assert out.forced == 0
        assert guided["eagle3"].pruned > 0  # the head's drafts inside the header the grammar fixes
