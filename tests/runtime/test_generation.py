"""The shared stopping rule, batched greedy generation, compositions and call metrics."""

from __future__ import annotations

import random

import torch

from schemafill.contract.callmetrics import exact_match, quality
from schemafill.contract.compose import compose, compositions
from schemafill.contract.parser import parse_prefix
from schemafill.contract.stopping import ResponseStop
from schemafill.contract.toolcall import ToolCall, ToolRequest, serialize_calls
from schemafill.runtime.generation import generate, prefix_order
from schemafill.runtime.loading import from_hf_model
from tests.conftest import tiny_llama

RESPONSE = serialize_calls([ToolCall("spotify.play", {"artist": "Beyoncé", "duration": 20}),
                            ToolCall("spotify.play", {"artist": "日本", "duration": 5})])


def test_stop_takes_exactly_the_token_that_closes_the_object(smol_tokenizer):
    ids = smol_tokenizer(RESPONSE + "\n\nextra text", add_special_tokens=False).input_ids
    stop = ResponseStop(smol_tokenizer, {smol_tokenizer.eos_token_id}, max_new_tokens=500)
    taken = stop.push(ids[:5]) + stop.push(ids[5:])  # several tokens per round, as speculation commits
    assert stop.reason == "closed" and stop.ids == ids[:taken]
    assert parse_prefix(smol_tokenizer.decode(ids[:taken])).closed
    assert not parse_prefix(smol_tokenizer.decode(ids[:taken - 1])).closed  # one token fewer is open
    assert stop.text.startswith(RESPONSE)
    assert stop.push(ids[:3]) == 0  # a finished response takes nothing more


def test_stop_on_eos_and_on_the_length_cap(smol_tokenizer):
    ids = smol_tokenizer(RESPONSE, add_special_tokens=False).input_ids
    eos = smol_tokenizer.eos_token_id
    stop = ResponseStop(smol_tokenizer, {eos}, max_new_tokens=500)
    assert stop.push(ids[:4] + [eos] + ids[4:]) == 5 and stop.reason == "eos" and stop.ids[-1] == eos
    capped = ResponseStop(smol_tokenizer, {eos}, max_new_tokens=7)
    assert capped.push(ids) == 7 and capped.reason == "length"


def test_stop_waits_for_split_multibyte_characters(smol_tokenizer):
    text = '{"tool_calls": [{"name": "f", "arguments": {"city": "Zürich 日本"}}]}'
    ids = smol_tokenizer(text, add_special_tokens=False).input_ids
    stop = ResponseStop(smol_tokenizer, set(), max_new_tokens=500)
    for tok in ids:
        stop.push([tok])
        assert stop.parser.state.error is None
    assert stop.reason == "closed" and stop.text == text


def test_continuous_batching_with_shared_prefixes_equals_transformers_greedy():
    """Rows refilled mid-stream, prompts sharing prefixes (KV copied between rows or kept in
    place), responses ending early or at the cap: every response equals transformers' own
    greedy search on the same weights, and batch 1."""
    model = tiny_llama(vocab_size=300, seed=1)
    target = from_hf_model(model, aux_layer_ids=[0, 1, 1])
    rng = random.Random(0)
    stem = [rng.randrange(3, 300) for _ in range(7)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 3)]
    prompts += [stem + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 4, 2, 6)] + [stem[:5], stem]
    order = prefix_order(prompts)
    assert order != list(range(len(prompts)))

    def tokenizer(eos: int):
        class Tok:  # the random model writes arbitrary ids: decode them as characters
            eos_token_id, pad_token_id = eos, 0

            @staticmethod
            def decode(ids, skip_special_tokens=True):
                return "".join(chr(65 + i % 26) for i in ids if not (skip_special_tokens and i == eos))
        return Tok

    free = generate(target, tokenizer(-1), prompts, max_new_tokens=12, batch_size=3)
    eos = free[0].ids[2]  # row 0 (and maybe others) stops early: rows are refilled mid-way
    ordered = generate(target, tokenizer(eos), [prompts[i] for i in order], max_new_tokens=12, batch_size=3)
    batched = [None] * len(prompts)
    for i, g in zip(order, ordered):
        batched[i] = g
    single = [generate(target, tokenizer(eos), [p], max_new_tokens=12, batch_size=1)[0] for p in prompts]
    assert [g.ids for g in batched] == [g.ids for g in single]
    assert batched[0].stop == "eos" and len(batched[0].ids) <= 3
    assert any(g.stop == "length" for g in batched)
    assert sum(g.prefilled for g in batched) < sum(map(len, prompts))  # prefixes were shared
    assert all(g.prefilled == len(p) for g, p in zip(single, prompts))
    for p, g in zip(prompts, batched):  # and equal to transformers' own greedy search
        ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert g.ids == ref[:cut]


def test_admissions_stop_where_admit_says_and_the_rows_under_way_finish():
    model = tiny_llama(vocab_size=300, seed=2)
    target = from_hf_model(model, aux_layer_ids=[0, 1, 1])
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 9))] for _ in range(7)]

    class Tok:
        eos_token_id, pad_token_id = -1, 0

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(65 + i % 26) for i in ids)

    whole = generate(target, Tok, prompts, max_new_tokens=6, batch_size=2)
    asked = []

    def admit(i: int) -> bool:
        asked.append(i)
        return i < 4

    cut = generate(target, Tok, prompts, max_new_tokens=6, batch_size=2, admit=admit)
    assert [g.ids for g in cut[:4]] == [g.ids for g in whole[:4]]  # started ones finish, unchanged
    assert cut[4:] == [None, None, None] and asked[-1] == 4  # nothing asked after the first refusal


def _req(rid, tool, calls, text=None, schema=None):
    return ToolRequest(id=rid, messages=[{"role": "user", "content": text or f"do {rid}"}],
                       tools=[{"type": "function", "function": {"name": tool, "description": "",
                                                                 "parameters": schema or {"type": "object", "properties": {}}}}],
                       reference=[ToolCall(tool, {"i": i}) for i in range(calls)])


def test_compose_joins_turns_catalogs_and_references():
    a, b = _req("a", "f", 1), _req("b", "g", 2)
    c = compose([a, b], "c0", random.Random(0))
    assert c.messages == [{"role": "user", "content": "do a\ndo b"}]
    assert sorted(c.tool_names) == ["f", "g"] and c.reference == a.reference + b.reference
    assert c.meta["parts"] == ["a", "b"]
    clash = _req("x", "f", 1, schema={"type": "object", "properties": {"z": {"type": "string"}}})
    assert compose([a, clash], "c1", random.Random(0)) is None


def test_compositions_are_seeded_and_mix_same_and_different_tools():
    pool = [_req(f"r{i}", f"t{i % 5}", 1) for i in range(40)]
    first = compositions(pool, 30, seed=7)
    assert [c.to_dict() for c in first] == [c.to_dict() for c in compositions(pool, 30, seed=7)]
    sizes = {len(c.reference) for c in first}
    assert sizes <= {2, 3, 4} and len(sizes) > 1
    same = [c for c in first if len({call.name for call in c.reference}) == 1]
    assert 0 < len(same) < len(first)
    assert all(len(set(c.meta["parts"])) == len(c.meta["parts"]) for c in first)


def test_call_quality_metrics():
    req = _req("a", "f", 2)
    ok = serialize_calls(list(reversed(req.reference)))
    wrong_name = serialize_calls([ToolCall("nope", {"i": 0})])
    q = quality([req, req, req], [ok, wrong_name, "not json"])
    assert q["valid_json_rate"] == 2 / 3 and q["tool_name_accuracy"] == 2 / 3
    assert q["exact_match"] == 1 / 3 and q["mean_calls"] == 1.0 and q["mean_reference_calls"] == 2
    assert exact_match(req.reference, list(reversed(req.reference)))
    assert not exact_match(req.reference, req.reference[:1])


def test_captured_features_equal_a_full_forward_over_each_row():
    """With capture, each generation carries the features of its own tokens — through
    refills, prefixes copied between rows and prefixes kept in place — equal to one
    transformers forward over prompt + response where a head's loss reads them."""
    from train.features import target_features

    aux_ids = [0, 1, 1]
    model = tiny_llama(vocab_size=300, seed=3)
    target = from_hf_model(model, aux_layer_ids=aux_ids)
    rng = random.Random(1)
    stem = [rng.randrange(3, 300) for _ in range(8)]
    prompts = [stem + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 3)] + [stem, [7, 8, 9]]

    class Tok:
        eos_token_id, pad_token_id = -1, 0

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(65 + i % 26) for i in ids)

    order = prefix_order(prompts)
    gens = generate(target, Tok, [prompts[i] for i in order], max_new_tokens=9, batch_size=2, capture=True)
    assert sum(g.prefilled for g in gens) < sum(map(len, prompts))  # prefixes were shared
    for i, g in zip(order, gens):
        row = prompts[i] + g.ids
        ref = target_features(model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long), aux_ids)
        p = len(prompts[i])
        assert g.aux.dtype == torch.float16 and g.aux.shape == (len(row) - 1, ref.aux.shape[-1])
        assert torch.allclose(g.aux.float(), ref.aux[0, :-1], atol=2e-3)
        assert g.final.shape == (len(g.ids), ref.final.shape[-1])
        assert torch.allclose(g.final.float(), ref.final[0, p - 1:-1], atol=2e-3)
        assert ref.argmax[0, p - 1:-1].tolist() == g.ids  # the greedy choice is the token written next
    plain = generate(target, Tok, [prompts[i] for i in order], max_new_tokens=9, batch_size=2)
    assert [g.ids for g in plain] == [g.ids for g in gens] and plain[0].aux is None
    seen = {}  # with a callback, it alone gets the features: the returned list does not keep them
    streamed = generate(target, Tok, [prompts[i] for i in order], max_new_tokens=9, batch_size=2, capture=True,
                        on_done=lambda k, g: seen.__setitem__(k, g))
    assert all(g.aux is None for g in streamed) and [g.ids for g in streamed] == [g.ids for g in gens]
    assert all(torch.equal(seen[k].aux, g.aux) for k, g in enumerate(gens))
