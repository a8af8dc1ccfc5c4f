"""Stage caching: a stage's stored result is reused only when its manifest names the same
fingerprint and every output is there."""

import json

from schemafill.fingerprint import fingerprint, is_fresh, load_if_fresh, write_manifest


def test_fingerprint_ignores_key_order_and_sees_values():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert len(fingerprint({})) == 16


def test_load_if_fresh_needs_the_fingerprint_and_every_output(tmp_path, capsys):
    outputs = ["stats.json", "data.jsonl"]
    (tmp_path / "stats.json").write_text(json.dumps({"rows": 3}))
    assert load_if_fresh("stage", tmp_path, "f1", outputs, "stats.json") is None  # no manifest yet
    write_manifest(tmp_path, "f1")
    assert not is_fresh(tmp_path, "f1", outputs)  # data.jsonl missing
    assert load_if_fresh("stage", tmp_path, "f1", outputs, "stats.json") is None
    (tmp_path / "data.jsonl").write_text("")
    assert load_if_fresh("stage", tmp_path, "f2", outputs, "stats.json") is None  # built from other inputs
    capsys.readouterr()

    stored = load_if_fresh("stage", tmp_path, "f1", outputs, "stats.json", lambda s: f"{s['rows']} rows")
    assert stored == {"rows": 3}
    assert capsys.readouterr().out == f"[stage] up to date in {tmp_path} (fingerprint f1): 3 rows\n"
    assert load_if_fresh("stage", tmp_path, "f1", outputs, "stats.json", quiet=True) == {"rows": 3}
    assert capsys.readouterr().out == ""


def test_a_corrupt_manifest_means_rebuild(tmp_path):
    (tmp_path / "stats.json").write_text("{}")
    (tmp_path / "manifest.json").write_text("{not json")
    assert load_if_fresh("stage", tmp_path, "f1", ["stats.json"], "stats.json") is None
