"""The target fine-tune's parts, on small literal cases: catalog trimming, example selection,
the learning-rate schedule, batching, the step-cost budget, and the detached-context loss
on a random model."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from schemafill.contract.toolcall import ToolCall, ToolRequest, serialize_calls
from tests.conftest import tiny_llama
from train.layer_split import lower_states
from train.sft import Progress, StepCost, detached_context_loss, loss_at_responses, lr_factor, response_loss
from train.sft_data import (
    Example,
    batches,
    closing_offsets,
    collate,
    decision_tokens,
    natural_first,
    split_collate,
    trim_catalog,
)


def request(tools: list[str], called: list[str]) -> ToolRequest:
    return ToolRequest(id="r", messages=[{"role": "user", "content": "x"}],
                       tools=[{"type": "function", "function": {"name": t, "parameters": {}}} for t in tools],
                       reference=[ToolCall(name, {}) for name in called])


def test_trimmed_catalog_keeps_called_tools_in_catalog_order():
    req = request(["a", "b", "c", "d", "e", "f"], ["e", "b"])
    trimmed = trim_catalog(req, 3, random.Random(0))
    names = trimmed.tool_names
    assert len(names) == 3 and {"b", "e"} <= set(names)
    assert names == [n for n in "abcdef" if n in names]  # the catalog's own order
    assert trim_catalog(req, 1, random.Random(0)).tool_names == ["b", "e"]  # never drops a called tool
    assert trim_catalog(req, 6, random.Random(0)) is req
    # the distractor is drawn at random, not always the first
    assert len({trim_catalog(req, 3, random.Random(s)).tool_names[0] for s in range(20)}
               | {trim_catalog(req, 3, random.Random(s)).tool_names[-1] for s in range(20)}) > 2


def test_natural_requests_come_before_compositions():
    bucket = [dataclasses.replace(request(["a"], ["a"]), id=f"c{i}", source="composed") for i in range(5)]
    bucket += [dataclasses.replace(request(["a"], ["a"]), id=f"n{i}", source="bfcl_v3") for i in range(3)]
    picked = natural_first(bucket, random.Random(0))
    assert sorted(r.id for r in picked[:3]) == ["n0", "n1", "n2"] and picked[3].source == "composed"
    assert sorted(r.id for r in picked) == sorted(r.id for r in bucket)


def test_lr_warms_up_then_decays_to_a_tenth():
    assert [lr_factor(0.0, s, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(0.0, 4, 4) == pytest.approx(1.0)
    assert lr_factor(0.5, 10, 4) == pytest.approx(0.55)
    assert lr_factor(1.0, 10, 4) == pytest.approx(0.1) == lr_factor(3.0, 10, 4)


def test_batches_stay_under_the_token_budget_and_cover_every_example():
    exs = [Example(f"e{i}", [1] * n, 1, 1) for i, n in enumerate([10, 30, 50, 20, 40, 60, 5, 25])]
    stream = batches(exs, 100, seed=0)
    epoch = []
    while sum(len(g) for g in epoch) < len(exs):
        epoch.append(next(stream))
    assert sorted(e.id for g in epoch for e in g) == sorted(e.id for e in exs)
    assert all(len(g) * max(len(e.input_ids) for e in g) <= 100 for g in epoch)
    with pytest.raises(ValueError, match="no examples"):
        next(batches([], 100, seed=0))


def test_step_cost_prices_first_visits_apart_and_with_a_margin():
    cost = StepCost(Progress())
    assert cost.predict(0, 100) is None  # nothing measured yet: no promise
    cost.observe(lower_tokens=100, lower_s=1.0, upper_tokens=100, upper_s=2.0)
    assert cost.predict(0, 50) == pytest.approx(1.15 * 1.0)
    assert cost.predict(100, 100) == pytest.approx(1.15 * 3.0)
    cost.observe(lower_tokens=0, lower_s=0.0, upper_tokens=100, upper_s=1.0)
    assert cost.predict(0, 100) == pytest.approx(1.15 * 2.0)  # the slowest recent rate, not the last
    resumed = StepCost(cost.progress)  # a rerun starts from the saved rates
    assert resumed.predict(100, 100) == pytest.approx(1.15 * (1.0 + 1.0))


def split_examples() -> list[Example]:
    g = torch.Generator().manual_seed(0)
    lengths = [(11, 6), (17, 9), (8, 3)]  # (prompt, response): contexts left-padded, tails right-padded
    decisions = [(12, 16), (17,), ()]  # response tokens, the first one included
    return [Example(f"e{i}", torch.randint(5, 500, (p + r,), generator=g).tolist(), p, 1, decisions=d)
            for i, ((p, r), d) in enumerate(zip(lengths, decisions))]


def test_decision_tokens_are_the_real_tokenizers_closing_tokens(smol_tokenizer):
    text = serialize_calls([ToolCall("f", {"n": 5, "s": "a, b]"}), ToolCall("g", {})])
    ids = smol_tokenizer(text, add_special_tokens=False).input_ids
    picked = decision_tokens(text, ids, smol_tokenizer)
    # after "f" and after 5; not the string's own "," and "]"; its object's close, the call's
    # and the next call; after "g"; the empty arguments, the call's and the list's closes
    assert [smol_tokenizer.decode([ids[i]]) for i in picked] == ['",', ",", '"}', "},", '",', " {}", "}", "]}"]
    inner = [i for i, t in enumerate(ids) if smol_tokenizer.decode([t]) in (",", "]")]
    assert len(inner) == 3 and set(inner) & set(picked) == {inner[0]}  # the one after 5 only
    with pytest.raises(ValueError, match="other tokens"):
        decision_tokens(text, ids[:-1], smol_tokenizer)


def test_decision_weight_reweights_only_the_marked_labels():
    model = tiny_llama(vocab_size=512, seed=4, num_hidden_layers=2)
    exs = split_examples()
    batch = collate(exs, pad_id=0)
    assert batch["decisions"].sum() == 3 and batch["decisions"][0, 12] and batch["decisions"][1, 17]
    final = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    plain = loss_at_responses(final, batch["labels"], model.lm_head)
    assert loss_at_responses(final, batch["labels"], model.lm_head, batch["decisions"], 1.0) == plain
    # by hand: each response label's cross-entropy, the marked ones counted 4 times
    logits = model.lm_head(final[:, :-1]).float()  # [B, T-1, V]
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    ce = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="none")
    w = 1 + 3 * batch["decisions"][:, 1:][keep].float()
    weighted = loss_at_responses(final, batch["labels"], model.lm_head, batch["decisions"], 4.0)
    assert torch.allclose(weighted, (ce * w).sum() / w.sum(), atol=1e-6) and not torch.allclose(weighted, plain)
    # the detached-context layout marks the same labels
    detached = detached_context_loss(model, split_collate(exs, pad_id=0), None, 0, decision_weight=4.0)
    assert torch.allclose(detached, weighted, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("split", [0, 2])
def test_detached_context_gives_the_exact_loss_and_cuts_only_the_context_kv_path(attn, split):
    model = tiny_llama(vocab_size=512, seed=3, num_hidden_layers=3, attn_implementation=attn)
    model.requires_grad_(False)
    top = model.model.layers[-1]
    params = {"mlp": top.mlp.down_proj.weight, "q": top.self_attn.q_proj.weight,
              "k": top.self_attn.k_proj.weight, "v": top.self_attn.v_proj.weight}
    for p in params.values():
        p.requires_grad_(True)
    exs = split_examples()
    exact = response_loss(model, collate(exs, pad_id=0))
    exact_grads = dict(zip(params, torch.autograd.grad(exact, list(params.values()))))
    states = [lower_states(model, e.input_ids, split) for e in exs] if split else None  # the frozen layers' cache
    detached = detached_context_loss(model, split_collate(exs, pad_id=0), states, split)
    grads = dict(zip(params, torch.autograd.grad(detached, list(params.values()))))
    assert torch.allclose(detached, exact, atol=1e-6)
    # in the top layer nothing of the context's *outputs* reaches the loss, only its keys and
    # values: the MLP's and the queries' gradients are the exact ones, the keys' and values' not
    for name in ("mlp", "q"):
        assert torch.allclose(grads[name], exact_grads[name], atol=1e-6), name
    for name in ("k", "v"):
        assert not torch.allclose(grads[name], exact_grads[name], atol=1e-4), name
        assert grads[name].abs().sum() > 0  # the responses' own keys and values still learn


def test_closing_offsets_skip_strings_and_escapes():
    text = '{"a": "x, y}", "b": [1, {"c": "q\\"]"}]}'
    assert [text[i] for i in closing_offsets(text)] == [",", ",", "}", "]", "}"]
    assert closing_offsets(text) == [13, 22, 36, 37, 38]
    assert closing_offsets('"a,b"') == [] and closing_offsets("") == []


def test_examples_are_drawn_to_the_call_mix_reading_only_what_the_draw_needs(builtin_artifacts, smol_tokenizer,
                                                                             make_cfg):
    from schemafill.contract.records import read_requests
    from train.sft_data import build_examples

    pool = read_requests(builtin_artifacts / "requests" / "train.jsonl")[0][::12]  # ~310 real requests
    cfg = make_cfg()
    roomy = dataclasses.replace(cfg.train.target, max_catalog=2, max_seq_len=4096, max_examples=40)
    examples, stats = build_examples(pool, smol_tokenizer, cfg.model, roomy, seed=0)
    candidates = stats["referenced"] + stats["composed"]
    assert stats["read"] == len(examples) < candidates / 4  # 40 examples tokenized, not the whole pool
    by_calls = [sum(min(e.calls, 4) == c for e in examples) for c in (1, 2, 3, 4)]
    assert by_calls == [int(40 / sum(roomy.call_mix) * s) for s in roomy.call_mix] == \
        list(stats["examples_by_calls"].values())
    for c in (1, 2, 3, 4):  # the corpus' own requests first, then compositions
        flags = [e.composed for e in examples if min(e.calls, 4) == c]
        assert flags == sorted(flags)

    # where few 4-call prompts fit, that bucket sets every bucket's count: the draw is the very
    # one of reading the whole pool (max_examples=0 tokenizes every candidate), read in part
    tight = dataclasses.replace(roomy, max_seq_len=768)
    examples, stats = build_examples(pool, smol_tokenizer, cfg.model, tight, seed=0)
    whole, whole_stats = build_examples(pool, smol_tokenizer, cfg.model, dataclasses.replace(tight, max_examples=0),
                                        seed=0)
    assert whole_stats["read"] == candidates and stats["read"] < candidates
    assert len(whole) < 40  # the cap is not what binds
    assert [e.id for e in examples] == [e.id for e in whole] and stats["examples_by_calls"] == \
        whole_stats["examples_by_calls"]
    assert all(len(e.input_ids) <= 768 for e in examples) and 0 < stats["skipped_too_long"] < stats["read"]
