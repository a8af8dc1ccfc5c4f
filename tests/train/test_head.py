"""The EAGLE-3 head: training-time-test visibility, the TTT loss on literal cases, draft
vocabulary maps, export round trip, and stage `head` end to end with resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from schemafill.runtime.drafter import DraftPart, Eagle3Head, HeadConfig, draft_vocab_from_counts, load_head, save_head, vocab_maps
from train.losses import ttt_loss


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Rotary inverse frequencies at ``theta``, as Llama's default rope computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def tiny_head(seed: int = 0, vocab: int = 50, draft: int = 20) -> Eagle3Head:
    torch.manual_seed(seed)
    c = HeadConfig(hidden_size=16, target_hidden_size=16, intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, vocab_size=vocab, draft_vocab_size=draft,
                   max_position_embeddings=64, rope_theta=10000.0, aux_layer_ids=[1, 2, 3])
    head = Eagle3Head(c, torch.nn.Embedding(vocab, 16), default_inv_freq(4, 10000.0))
    for p in head.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    head.set_vocab(torch.arange(0, vocab, vocab // draft)[:draft])
    return head.eval()


def test_vocab_maps_literal():
    d2t, t2d = vocab_maps(torch.tensor([0, 3, 4, 9]), 10)
    assert d2t.tolist() == [0, 2, 2, 6]  # draft id i -> target id i + d2t[i]
    assert t2d.nonzero().flatten().tolist() == [0, 3, 4, 9]
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    assert draft_vocab_from_counts(counts, 3).tolist() == [0, 2, 3]  # ties keep the lower id
    assert draft_vocab_from_counts(counts, 3, always=[5]).tolist() == [2, 3, 5]


def test_step0_is_causal_and_later_steps_see_only_their_diagonal():
    head = tiny_head()
    ids = torch.randint(0, 50, (1, 8))
    aux = torch.randn(1, 8, 48)
    valid = torch.ones(1, 8, dtype=torch.bool)
    base = [head.logits(o) for o in head.ttt_forward(ids, aux, valid, horizons=3)]
    # changing the feature at position 5 leaves every step's outputs before position 5 unchanged
    aux2 = aux.clone()
    aux2[0, 5] += 1.0
    changed = [head.logits(o) for o in head.ttt_forward(ids, aux2, valid, horizons=3)]
    for k in range(3):
        assert torch.allclose(base[k][0, :5], changed[k][0, :5], atol=1e-6)
        assert not torch.allclose(base[k][0, 5], changed[k][0, 5])
    # step 0 equals a plain causal run on the prefix alone
    short = [head.logits(o) for o in head.ttt_forward(ids[:, :4], aux[:, :4], valid[:, :4], horizons=1)]
    assert torch.allclose(short[0][0, :3], base[0][0, :3], atol=1e-5)


def test_queries_from_start_give_the_same_outputs():
    """The prompt contributes keys only: outputs from ``start`` equal the full run's there."""
    head = tiny_head(2)
    ids = torch.randint(0, 50, (2, 9))
    aux = torch.randn(2, 9, 48)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 7:] = False  # a right-padded row
    full = head.ttt_forward(ids, aux, valid, horizons=3)
    for start in (1, 4, 8):
        part = head.ttt_forward(ids, aux, valid, horizons=3, start=start)
        for k in range(3):
            assert part[k].shape == (2, 9 - start, 16)
            assert torch.allclose(part[k], full[k][:, start:], atol=1e-5)


def test_step_k_uses_the_heads_own_previous_output():
    """Step 1 at position t must equal: run step 0, then attend to step-0 keys <= t plus its own key."""
    head = tiny_head(1)
    ids = torch.randint(0, 50, (1, 6))
    aux = torch.randn(1, 6, 48)
    out = [head.logits(o) for o in head.ttt_forward(ids, aux, torch.ones(1, 6, dtype=torch.bool), horizons=2)]
    # Reference: drafting like inference, for position t=2: keys of step 0 at positions 0..2, then one new token
    layer, t = head.midlayer, 2
    pos = torch.arange(6)[None]
    cos, sin = head.rotary(pos, torch.float32)
    hidden0 = head.fc(aux)
    q0, k0, v0 = layer.qkv(head.embed_tokens(torch.roll(ids, -1, 1)), hidden0, cos, sin)
    from schemafill.runtime.layers import attend
    vis0 = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    o0 = layer.finish(hidden0, attend(q0, k0, v0, vis0))
    cos1, sin1 = head.rotary(pos[:, t:t + 1] + 1, torch.float32)
    q1, k1, v1 = layer.qkv(head.embed_tokens(ids[:, t + 2:t + 3]), o0[:, t:t + 1], cos1, sin1)
    keys = torch.cat([k0[:, :, : t + 1], k1], dim=2)
    vals = torch.cat([v0[:, :, : t + 1], v1], dim=2)
    o1 = layer.finish(o0[:, t:t + 1], attend(q1, keys, vals, torch.ones(1, 1, t + 2, dtype=torch.bool)))
    assert torch.allclose(head.logits(o1)[0, 0], out[1][0, t], atol=1e-5)


def test_ttt_loss_literal_masks_and_accuracy():
    # T=5, Vd=3 with draft ids -> target ids [10, 11, 12]; target vocab 13
    t2d = torch.zeros(13, dtype=torch.bool)
    t2d[[10, 11, 12]] = True
    draft_to_target = torch.tensor([10, 11, 12])
    target_logits = torch.full((1, 5, 3), -10.0)
    target_logits[0, :, 1] = 10.0  # target prefers draft id 1 (= target 11) everywhere
    target_argmax = torch.tensor([[11, 11, 11, 5, 11]])  # position 3's greedy token is outside the draft vocab
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])
    head0 = torch.zeros(1, 5, 3)
    head0[0, :, 1] = 5.0  # right at every position
    head1 = torch.zeros(1, 5, 3)
    head1[0, :, 0] = 5.0  # wrong at every position
    res = ttt_loss([head0, head1], lambda x: x, target_logits, lambda x: x, target_argmax, loss_mask, t2d,
                   draft_to_target,
                   decay=0.8)
    # step 0: t in 0..2 predicts x[t+2] in {2,3,4} (all response); label at t+1 in {1,2,3}; position 3 masked
    assert res.step_count == [2, 1] and res.step_correct == [2, 0]
    assert res.step_loss[0] < 0.02 and res.step_loss[1] > 4.0
    assert torch.isclose(res.loss, torch.tensor(res.step_loss[0] + 0.8 * res.step_loss[1]), atol=1e-5)


def test_export_round_trip(tmp_path):
    head = tiny_head(2)
    save_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 20 and config["target_hidden_size"] == 16
    assert config["schemafill_aux_layer_ids"] == {"ids": [1, 2, 3], "convention": "hf_hidden_states_index"}
    assert config["num_aux_hidden_states"] == 3
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight", "midlayer.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith("embed_tokens") for k in keys)
    back = load_head(tmp_path, head.embed_tokens, default_inv_freq(4, 10000.0)).eval()
    ids, aux = torch.randint(0, 50, (1, 7)), torch.randn(1, 7, 48)
    valid = torch.ones(1, 7, dtype=torch.bool)
    for a, b in zip(head.ttt_forward(ids, aux, valid, 2), back.ttt_forward(ids, aux, valid, 2)):
        assert torch.equal(head.logits(a), back.logits(b))
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_drafting_over_the_arena_reproduces_training_time_test():
    """decode_step with KV reproduces ttt_forward: step 0 over committed positions, then a
    step-1 node per position fed with its step-0 output, seeing committed keys up to its
    position and itself — the geometry the head was trained under."""
    head = tiny_head(seed=3)
    t = 9
    ids, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 48)
    with torch.no_grad():
        step0, step1 = head.ttt_forward(ids, aux, torch.ones(1, t, dtype=torch.bool), horizons=2)
    arena = head.new_arena(32)
    pos = torch.arange(t - 1)[None]
    visible = torch.ones(t - 1, t - 1, dtype=torch.bool).tril()[None]
    out0 = head.decode_step(ids[:, 1:], head.fc(aux[:, :-1]), pos, visible, pos, arena)
    assert torch.allclose(out0, step0[:, :-1], atol=1e-5)
    for p in range(t - 2):  # one draft node at a time, in a scratch slot past the committed ones
        visible = torch.zeros(1, 1, 20, dtype=torch.bool)
        visible[0, 0, :p + 1] = True
        visible[0, 0, 19] = True
        node = head.decode_step(ids[:, p + 2:p + 3], out0[:, p:p + 1], torch.tensor([[p + 1]]), visible,
                                torch.tensor([[19]]), arena)
        assert torch.allclose(node[0, 0], step1[0, p], atol=1e-5), p


def test_a_packed_drafting_forward_gives_each_request_what_it_gets_alone():
    """Three requests' drafting rows in one forward (``decode_packed``): each gets the outputs
    and writes the KV it would alone, over its own arena, whatever the others' lengths."""
    head = tiny_head(seed=5)
    g = torch.Generator().manual_seed(1)
    parts, alone_arenas = [], []
    for t, width in ((4, 6), (1, 9), (3, 3)):  # rows, and slots each request's rows see
        arena, prior = head.new_arena(16), head.new_arena(16)
        for mine, same in zip(arena.k + arena.v, prior.k + prior.v):  # committed KV both copies hold
            mine.copy_(torch.randn(mine.shape, generator=g))
            same.copy_(mine)
        slots = torch.arange(width - t, width)
        visible = torch.ones(t, width, dtype=torch.bool).tril(width - t)
        parts.append(DraftPart(arena, torch.randint(0, 50, (t,), generator=g), torch.randn(t, 16, generator=g),
                               slots, visible, slots))
        alone_arenas.append(prior)
    with torch.no_grad():
        together = head.decode_packed(parts)
        for p, prior, out in zip(parts, alone_arenas, together):
            alone = head.decode_step(p.input_ids[None], p.hidden[None], p.positions[None], p.visibility[None],
                                     p.write_slots[None], prior)[0]
            assert out.shape == alone.shape and torch.allclose(out, alone, atol=1e-5)
            for mine, same in zip(p.arena.k + p.arena.v, prior.k + prior.v):
                assert torch.allclose(mine, same, atol=1e-5)


def test_rows_whose_outputs_nobody_reads_write_kv_only_and_the_rest_are_unchanged():
    """A catch-up reads the output of its newest row alone: with ``outputs`` named, the other
    rows write the same keys and values and skip the query, attention and MLP — the named
    rows' outputs equal the whole forward's, packed with a request that names none and alone."""
    head = tiny_head(seed=7)
    g = torch.Generator().manual_seed(3)

    def part(t: int, outputs):
        arena = head.new_arena(16)
        visible = torch.ones(t, t, dtype=torch.bool).tril()
        slots = torch.arange(t)
        return DraftPart(arena, torch.randint(0, 50, (t,), generator=g), torch.randn(t, 16, generator=g),
                         slots, visible, slots, outputs)

    def copy(p, outputs):
        return DraftPart(head.new_arena(16), p.input_ids, p.hidden, p.positions, p.visibility, p.write_slots, outputs)

    catch_up, level = part(6, [5]), part(2, None)
    whole = [copy(catch_up, None), copy(level, None)]
    with torch.no_grad():
        some, every = head.decode_packed([catch_up, level]), head.decode_packed(whole)
        lone = head.decode_step(catch_up.input_ids[None], catch_up.hidden[None], catch_up.positions[None],
                                catch_up.visibility[None], catch_up.write_slots[None], head.new_arena(16), [1, 5])[0]
    assert some[0].shape == (1, 16) and torch.allclose(some[0], every[0][[5]], atol=1e-5)
    assert torch.allclose(some[1], every[1], atol=1e-5)
    assert lone.shape == (2, 16) and torch.allclose(lone, every[0][[1, 5]], atol=1e-5)
    for p, q in zip([catch_up, level], whole):
        for mine, same in zip(p.arena.k + p.arena.v, q.arena.k + q.arena.v):
            assert torch.allclose(mine, same, atol=1e-5)


def vllm_reads(config: dict) -> list[int]:
    """HF hidden_states indices vLLM feeds the head: the top-level key first, else eagle_config's
    (v1/worker/gpu_model_runner.py), each the input of layer i; sorted (models/interfaces.py)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return sorted(set(ids))


def sglang_reads(config: dict) -> list[int]:
    """HF hidden_states indices SGLang feeds the head: only eagle_config's ids, captured as
    ``[val + 1 for val in layer_ids]`` inputs of layers (srt/models/llama.py)."""
    return [v + 1 for v in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


@pytest.mark.parametrize("aux", [[2, 15, 27], [2, 14, 25], [1, 2, 3]])
def test_both_engines_read_the_layers_the_head_was_trained_on(tmp_path, aux):
    from dataclasses import replace

    from schemafill.runtime.drafter import export_config

    config = export_config(replace(tiny_head(0).config, aux_layer_ids=aux))
    assert vllm_reads(config) == aux and sglang_reads(config) == aux
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]


def test_layer_ids_the_engines_cannot_feed_are_refused():
    from schemafill.runtime.drafter import engine_layer_ids

    with pytest.raises(ValueError, match="ascending"):
        engine_layer_ids([15, 2, 27])  # both engines capture in layer order: fc would get them permuted
    with pytest.raises(ValueError, match="SGLang"):
        engine_layer_ids([0, 5, 9])
