"""Stage `continuations` on a tiny random target: columns and masks, context skips,
structured outputs under their grammar, resume after a kill, and multi-process generation
equal to one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch

from data_gen.continuations import build_continuations, continuations_dir
from data_gen.splits import structured_set
from schemafill.config import to_dataclass
from schemafill.contract.records import read_requests
from schemafill.contract.response_format import object_format
from schemafill.contract.stopping import ResponseStop
from schemafill.runtime.generation import generate
from schemafill.runtime.grammar import SchemaGrammars, valid_response
from schemafill.runtime.loading import load_runtime, load_tokenizer
from tests.conftest import ROOT, accelerate_launch, compose


def overrides(artifacts: Path, tiny: Path, *extra: str, tokens: int = 12) -> list[str]:
    return [f"paths.artifacts={artifacts}", "logger=none", "model.finetune=false", f"model.source={tiny}",
            "model.name=tiny", "model.aux_layer_ids=[1,2,3]", f"decode.max_new_tokens={tokens}",
            "data.continuations.max_requests=16", "data.continuations.structured=0.25",
            "data.continuations.shard_size=4", "data.continuations.batch_size=4", *extra]


def copy_requests(src: Path, dst: Path) -> None:
    (dst / "requests").mkdir(parents=True)
    for name in ("train.jsonl", "bfcl450.jsonl"):
        (dst / "requests" / name).write_text((src / "requests" / name).read_text())


def load_rows(cfg) -> list[dict]:
    ds = datasets.load_from_disk(str(continuations_dir(cfg)))
    return sorted(ds.to_list(), key=lambda r: r["id"])


def test_rows_masks_and_stats(builtin_artifacts, tiny_target, tmp_path):
    copy_requests(builtin_artifacts, tmp_path)
    cfg = to_dataclass(compose(overrides(tmp_path, tiny_target, "data.continuations.max_prompt_tokens=700")))
    stats = build_continuations(cfg)
    rows = load_rows(cfg)
    assert stats["rows"] == len(rows) and stats["rows"] + stats["skipped"] == stats["requests"] == 24
    assert stats["skipped_by_reason"] and stats["skipped"] > 0  # long live_* prompts over 700 tokens
    composed = sum(r["id"].startswith("cont_composed") for r in rows)
    assert stats["composed_share"] == composed / len(rows) and stats["tokens_per_s"] > 0
    structured = [r for r in rows if r["id"].endswith("/structured")]
    assert structured and stats["structured_share"] == len(structured) / len(rows)
    chosen = 0
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"])
        assert r["loss_mask"][: r["prompt_len"]] == [0] * r["prompt_len"]  # no loss on prompt tokens
        if r in structured:  # the grammar chose where the random target would not write the object
            chosen += r["loss_mask"].count(0) - r["prompt_len"]
        else:
            assert r["loss_mask"][r["prompt_len"]:] == [1] * (len(r["input_ids"]) - r["prompt_len"])
            assert sum(r["loss_mask"]) >= 1
    assert stats["grammar_chosen_tokens"] == chosen > 0
    assert build_continuations(cfg)["cached"] is True


def test_a_structured_output_is_generated_under_its_schema_and_learnt_where_the_target_chose(builtin_artifacts,
                                                                                             tiny_target, tmp_path):
    """Under the grammar every answer is its schema's object, and the target's own greedy token
    is kept at every position (a token carries loss exactly where it is that one)."""
    requests, _ = read_requests(builtin_artifacts / "requests" / "bfcl450.jsonl")
    reqs = structured_set(requests[:3])
    tok = load_tokenizer(str(tiny_target))
    target = load_runtime(str(tiny_target), torch.float32, torch.device("cpu"), [1, 2, 3], decodes=False)
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    prompts = [tok(f"Answer: {r.user_text()}", add_special_tokens=False).input_ids for r in reqs]
    gens = generate(target, tok, prompts, 48, 2, eos=frozenset({tok.eos_token_id}),
                    make_stop=lambda i: ResponseStop(tok, frozenset({tok.eos_token_id}), 48,
                                                     fmt=reqs[i].response_format(object_format("x"))),
                    constrain=lambda i: grammars.constraint([reqs[i].output_function], fmt=reqs[i].response_format(
                        object_format("x")), close_at=16))
    for r, p, g in zip(reqs, prompts, gens):
        assert g.stop == "closed" and valid_response(g.text, r.slot_functions, fmt=r.response_format(object_format("x")))
        # each token's own greedy choice, one forward over the prompt and the answer so far
        alone = generate(target, tok, [p + g.ids[:i] for i in range(len(g.ids))], 1, 4,
                         make_stop=lambda i: ResponseStop(tok, frozenset(), 1))
        assert g.greedy == [a.ids[0] for a in alone]
        assert g.greedy != g.ids  # a random target does not write the schema's object by itself


def test_resume_after_kill_loses_and_duplicates_nothing(builtin_artifacts, tiny_target, tmp_path):
    copy_requests(builtin_artifacts, tmp_path)
    # long enough answers that a shard's wave takes longer than a poll: the tiny target decodes
    # a 12-token wave of four requests faster than the loop below looks
    args = overrides(tmp_path, tiny_target, "data.continuations.max_prompt_tokens=900", tokens=64)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "data_gen/run.py", "stages=[continuations]", *args], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    shards = tmp_path / "continuations" / ".tiny.shards"
    deadline = time.time() + 240
    while time.time() < deadline and not list(shards.glob("*/shard_*.jsonl")):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # killed mid-run, at whatever point it had reached
    proc.wait()
    finished = len(list(shards.glob("*/shard_*.jsonl")))
    assert 1 <= finished < 6, "the run should have been interrupted after a shard and before the end"
    assert not (tmp_path / "continuations" / "tiny").exists()

    cfg = to_dataclass(compose(args))
    stats = build_continuations(cfg)
    assert stats["shards_reused"] == finished and stats["shards"] == 6
    rows = load_rows(cfg)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == stats["rows"] and stats["rows"] + stats["skipped"] == 24
    # the same rows as an uninterrupted run
    fresh = tmp_path / "fresh"
    copy_requests(builtin_artifacts, fresh)
    cfg2 = to_dataclass(compose(overrides(fresh, tiny_target, "data.continuations.max_prompt_tokens=900", tokens=64)))
    build_continuations(cfg2)
    assert load_rows(cfg2) == rows


@pytest.mark.slow
def test_two_processes_give_the_same_rows_as_one(builtin_artifacts, tiny_target, tmp_path):
    runs = {}
    for n in (1, 2):
        art = tmp_path / f"p{n}"
        copy_requests(builtin_artifacts, art)
        args = overrides(art, tiny_target, "data.continuations.max_prompt_tokens=900")
        accelerate_launch(n, "data_gen/run.py", "stages=[continuations]", *args)
        runs[n] = load_rows(to_dataclass(compose(args)))
        assert json.loads((continuations_dir(to_dataclass(compose(args))) / "stats.json").read_text())["rows"]
    assert runs[1] == runs[2] and len(runs[1]) > 0


def test_a_time_budget_keeps_whole_shards_and_a_larger_one_resumes(builtin_artifacts, tiny_target, tmp_path):
    """Past ``max_minutes`` no shard starts; what finished is the dataset (a sample of the
    pool: shards are random draws), and a run without the budget generates only the rest."""
    copy_requests(builtin_artifacts, tmp_path)
    base = overrides(tmp_path, tiny_target, "data.continuations.max_prompt_tokens=900")
    budgeted = build_continuations(to_dataclass(compose(base + ["data.continuations.max_minutes=1e-6"])))
    assert budgeted["stopped_by"] == "max_minutes"
    assert 1 <= budgeted["shards"] < budgeted["shards_planned"] == 6
    first = load_rows(to_dataclass(compose(base)))
    assert len(first) == budgeted["rows"] and 0 < len(first) < 20
    whole = build_continuations(to_dataclass(compose(base)))
    assert whole["stopped_by"] is None and whole["shards_reused"] == budgeted["shards"] and whole["shards"] == 6
    rows = {r["id"]: r for r in load_rows(to_dataclass(compose(base)))}
    assert all(rows[r["id"]]["input_ids"] == r["input_ids"] for r in first)  # kept, not generated again
