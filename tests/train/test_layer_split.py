"""The frozen-layer cache is exact: the split forward equals the whole model's, and training
the top layers on cached lower states gives the whole model's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from train.layer_split import lower_states, pad_states, upper_final
from train.sft import loss_at_responses, response_loss
from train.sft_data import Example, collate


def examples() -> list[Example]:
    g = torch.Generator().manual_seed(0)
    lengths = [(11, 6), (17, 9), (8, 3)]  # (prompt, response): different lengths, so rows are padded
    return [Example(f"e{i}", torch.randint(5, 500, (p + r,), generator=g).tolist(), p, 1)
            for i, (p, r) in enumerate(lengths)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("split", [0, 2, 4])
def test_split_forward_equals_the_whole_model(attn, split):
    model = tiny_llama(vocab_size=512, seed=1, num_hidden_layers=4, attn_implementation=attn)
    exs = examples()
    batch = collate(exs, pad_id=0)
    with torch.no_grad():
        whole = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        split_out = upper_final(model, pad_states([lower_states(model, e.input_ids, split) for e in exs]), split)
    for i, e in enumerate(exs):  # padding positions may differ; real ones must not
        n = len(e.input_ids)
        assert torch.allclose(split_out[i, :n], whole[i, :n], atol=1e-5), (attn, split, i)


def test_training_on_cached_states_gives_the_whole_models_gradients():
    model = tiny_llama(vocab_size=512, seed=2, num_hidden_layers=4)
    model.requires_grad_(False)
    top = list(model.model.layers[2:].parameters())
    for p in top:
        p.requires_grad_(True)
    exs = examples()
    batch = collate(exs, pad_id=0)
    whole = response_loss(model, batch)
    whole_grads = torch.autograd.grad(whole, top)
    states = pad_states([lower_states(model, e.input_ids, 2) for e in exs])
    assert not states.requires_grad  # the frozen part built no graph
    cached = loss_at_responses(upper_final(model, states, 2), batch["labels"], model.lm_head)
    cached_grads = torch.autograd.grad(cached, top)
    assert torch.allclose(cached, whole, atol=1e-6)
    for a, b in zip(cached_grads, whole_grads):
        assert torch.allclose(a, b, atol=1e-6)
