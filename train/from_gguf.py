"""A llama-architecture GGUF file read as a Hugging Face ``LlamaConfig`` and float32 state dict.

transformers reads GGUF too, but parses the whole file three times for one model (config,
weights, tokenizer), element by element, and builds a tensor-name table per tensor: half a
minute for the built-in target's 98 MB. Here the file is read once: its metadata with
``struct``, its tensors as views of one memory map, dequantized by the ``gguf`` package
(llama.cpp's own reference code, which transformers calls as well, so the weights are the
same bits). Only what a Llama checkpoint holds is mapped; anything else is refused by name.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

# GGUF metadata value types (gguf.constants.GGUFValueType): struct format of each scalar
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9

# llama.cpp tensor names → transformers', per block and for the whole model
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _read(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, n = _read(f, "<I"), _read(f, "<Q")
        if item in SCALARS:  # one read for the whole array
            return np.frombuffer(f.read(n * struct.calcsize(SCALARS[item])), dtype=np.dtype(SCALARS[item])).tolist()
        return [_value(f, item) for _ in range(n)]
    if kind not in SCALARS:
        raise ValueError(f"unknown GGUF metadata value type {kind}")
    return _read(f, SCALARS[kind])


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, int, tuple[int, ...]]]]:
    """The file's metadata, and each tensor as (raw bytes, GGML type, shape in torch's order)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        meta = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, _read(f, "<I"))
        infos = []
        for _ in range(n_tensors):
            name = _string(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            infos.append((name, dims, _read(f, "<I"), _read(f, "<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        shape = tuple(reversed(dims))  # GGUF lists the innermost dimension first
        nbytes = int(np.prod(dims)) // block * size
        tensors[name] = (data[start + offset: start + offset + nbytes], kind, shape)
    return meta, tensors


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Q or K projection's rows: per head, its converter
    interleaves the two rotary halves (row r of half h → row 2r + h); transformers' rotary
    pairs row r with row r + head_dim/2."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in BLOCK_NAMES:
            return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{suffix}"
    elif stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama checkpoint")


def llama_checkpoint(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """A ``LlamaConfig`` and its float32 state dict, read from a llama-architecture GGUF file."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import LlamaConfig

    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}; only llama GGUF files are read here")
    heads, kv_heads = meta["llama.attention.head_count"], meta.get("llama.attention.head_count_kv",
                                                                    meta["llama.attention.head_count"])
    hidden = meta["llama.embedding_length"]
    state = {}
    for name, (raw, kind, shape) in tensors.items():
        values = dequantize(raw.reshape(shape[:-1] + (-1,)), GGMLQuantizationType(kind))
        w = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy: the map is read-only
        if name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, heads)
        elif name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, kv_heads)
        state[_hf_name(name)] = w
    config = LlamaConfig(
        vocab_size=state["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden, intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=meta.get("llama.rope.dimension_count", hidden // heads),
        max_position_embeddings=meta.get("llama.context_length", 2048),
        rms_norm_eps=meta.get("llama.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.get("llama.rope.freq_base", 10000.0),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        tie_word_embeddings="lm_head.weight" not in state,
    )
    return config, state
