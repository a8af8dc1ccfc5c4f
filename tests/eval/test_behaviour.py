"""The behaviour comparison that guards refactors of the decoding code, on literal records."""

from __future__ import annotations

import copy
import json

import pytest

from infer.eval.behaviour import differences, main, record


def row(ids, calls, nodes):
    return {"output_ids": ids, "stop": "closed", "target_calls": calls, "nodes": nodes, "forced": 0, "pruned": 0}


BEFORE = {"limit": 2, "modes": {"greedy": {
    "ar": {"a#0": row([1, 2, 3], 4, []), "b#0": row([5], 2, [])},
    "eagle3": {"a#0": row([1, 2, 3], 2, [8, 8]), "b#0": row([5], 2, [8])},
}}}


def test_identical_records_compare_equal_and_every_request_counts():
    assert differences(BEFORE, copy.deepcopy(BEFORE)) == (4, [])


def test_any_changed_field_or_missing_part_is_named():
    after = copy.deepcopy(BEFORE)
    after["modes"]["greedy"]["eagle3"]["a#0"]["target_calls"] = 3  # same tokens, one call more
    after["modes"]["greedy"]["eagle3"]["a#0"]["nodes"] = [8, 6, 2]
    del after["modes"]["greedy"]["ar"]["b#0"]
    compared, lines = differences(BEFORE, after)
    assert compared == 4
    assert lines == ["greedy/ar/b#0: not in the second record",
                     "greedy/eagle3/a#0: target_calls 2 -> 3, nodes [8, 8] -> [8, 6, 2]"]
    assert differences(BEFORE, {"modes": {}})[1] == ["greedy: not in the second record"]


def test_compare_exits_nonzero_on_a_difference(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(BEFORE))
    b.write_text(json.dumps(BEFORE))
    assert main(["compare", str(a), str(b)]) == 0
    changed = copy.deepcopy(BEFORE)
    changed["modes"]["greedy"]["ar"]["a#0"]["output_ids"] = [1, 2, 4]
    b.write_text(json.dumps(changed))
    assert main(["compare", str(a), str(b)]) == 1
    assert "greedy/ar/a#0: output_ids [1, 2, 3] -> [1, 2, 4]" in capsys.readouterr().out


def test_a_record_resumes_only_with_the_same_requests(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps(BEFORE))  # limit 2; every mode it asks for below is new
    (tmp_path / "requests").mkdir()
    (tmp_path / "requests" / "bfcl450.jsonl").write_text("")
    (tmp_path / "heads" / "m").mkdir(parents=True)
    (tmp_path / "heads" / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--limit 2, not 30"):
        record(out, tmp_path, "m", None, 30, ["sampled"])


def test_records_priced_on_other_cost_curves_are_named_first():
    before = {**copy.deepcopy(BEFORE), "cost_model": {"greedy": {"sizes": [1, 64], "ms": [50.0, 180.0]}}}
    after = {**copy.deepcopy(BEFORE), "cost_model": {"greedy": {"sizes": [1, 64], "ms": [51.0, 180.0]}}}
    compared, lines = differences(before, after)
    assert compared == 4 and len(lines) == 1 and lines[0].startswith("greedy: the cost curves differ")
    assert differences(before, copy.deepcopy(before)) == (4, [])
