"""``train.from_gguf``: llama.cpp's rotary row order undone on literal rows, and a small Llama
written by the ``gguf`` package's own writer (as llama.cpp's converter writes one: Q/K rows
reordered, some tensors quantized) read back into the checkpoint it came from. The built-in
target's conversion is checked against transformers' GGUF loading in test_target.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.conftest import tiny_llama
from train.from_gguf import llama_checkpoint, unpermute_rotary


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``, as its authors wrote it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_rotary_rows_return_to_transformers_order():
    # one head of 4 rows: llama.cpp interleaves the halves [0, 1 | 2, 3] as 0, 2, 1, 3
    assert unpermute_rotary(torch.tensor([[0.0], [2.0], [1.0], [3.0]]), heads=1).flatten().tolist() == [0, 1, 2, 3]
    # two heads, each on its own rows
    gguf_rows = torch.tensor([0.0, 2, 1, 3, 4, 6, 5, 7])[:, None]
    assert unpermute_rotary(gguf_rows, heads=2).flatten().tolist() == list(range(8))
    w = torch.randn(48, 5)
    assert torch.equal(unpermute_rotary(torch.from_numpy(llama_cpp_permute(w.numpy(), 3)), 3), w)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_gguf(path, model, quantized=("ffn_up", "token_embd")) -> dict[str, np.ndarray]:
    """``model`` as a GGUF file; returns the values a reader must find (quantized ones dequantized)."""
    c = model.config
    w = GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c.vocab_size)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])  # an array of strings read (and passed over) too
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[part]}.{suffix}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        values = t.numpy()
        if gname.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, c.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, c.num_key_value_heads)
        if any(q in gname for q in quantized):
            raw = quantize(values, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, raw, raw_dtype=GGMLQuantizationType.Q8_0)
            expected[name] = dequantize(raw, GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, values)
            expected[name] = t.numpy()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_a_written_llama_reads_back_as_its_checkpoint(tmp_path):
    model = tiny_llama(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    expected = write_llama_gguf(tmp_path / "tiny.gguf", model)
    config, state = llama_checkpoint(tmp_path / "tiny.gguf")

    assert set(state) == set(expected)  # no lm_head: tied
    for name, values in expected.items():
        assert torch.equal(state[name], torch.from_numpy(values)), name
    # quantized tensors are near, not equal, to the model's; Q/K rows are back in transformers' order
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"], model.model.layers[1].self_attn.q_proj.weight)
    assert torch.equal(state["model.layers.1.self_attn.k_proj.weight"], model.model.layers[1].self_attn.k_proj.weight)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (2, 64, 4, 2, 256)
    assert config.tie_word_embeddings and config.bos_token_id == 1 and config.eos_token_id == 2
    assert config.rope_parameters["rope_theta"] == 50000.0 and config.rms_norm_eps == pytest.approx(1e-5)


def test_what_is_not_a_llama_gguf_is_refused_by_name(tmp_path):
    (tmp_path / "not.gguf").write_bytes(b"GGML\x00\x00")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llama_checkpoint(tmp_path / "not.gguf")
    w = GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        llama_checkpoint(tmp_path / "gpt2.gguf")
