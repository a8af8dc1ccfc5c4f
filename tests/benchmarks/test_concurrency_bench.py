"""The concurrency bench's own code against a batching server on a tiny random target (the
bench runs the built-in one): every client's answer is collected, throughput is over the
wall time, and the plot is written."""

from __future__ import annotations

from benchmarks.concurrency_bench import plot, run_level
from schemafill.contract.records import read_requests
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)
from tests.serving.test_load import busy  # noqa: F401  (fixture)
from tests.serving.test_serve import MODEL


def test_clients_share_the_requests_and_their_answers_match_one_clients(busy, builtin_artifacts, tmp_path):  # noqa: F811
    engine, server = busy
    requests = read_requests(builtin_artifacts / "requests" / "bfcl450.jsonl")[0][::75][:5]
    one = run_level(server.url, f"{MODEL}:eagle3", requests, 1)
    three = run_level(server.url, f"{MODEL}:eagle3", requests, 3)
    for r in (one, three):
        assert not r["errors"] and all(a is not None for a in r["answers"])
        assert r["tokens"] > 0 and abs(r["tps"] * r["wall_s"] - r["tokens"]) < 0.01 * r["tokens"]  # over the wall time
        assert 0 < r["p50_s"] <= r["p95_s"] <= r["wall_s"]
    assert three["answers"] == one["answers"] and three["tokens"] == one["tokens"]
    rows = {"eagle3": [{k: v for k, v in r.items() if k != "answers"} for r in (one, three)]}
    plot(rows, tmp_path / "c.png", "test host")
    assert (tmp_path / "c.png").stat().st_size > 1000
