"""The concurrency bench's own code against a batching server on a tiny random target (the
bench runs the built-in one): every client's answer is collected from its stream, throughput
is over the wall time, agents carry their conversations on, a quarter of the clients hang up
and each request is counted once, and the plot is written."""

from __future__ import annotations

import json

from benchmarks.concurrency_bench import (Turn, check_answers, followed, hangup_check, plot, prompt_counts,
                                          run_level)
from schemafill.contract.records import read_requests, spread
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)
from tests.serving.test_load import busy  # noqa: F401  (fixture)
from tests.serving.test_serve import MODEL


def test_every_prefix_of_a_spread_is_spread():
    assert spread(list(range(8)), 8) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert spread(list(range(12)), 6) == [0, 8, 4, 2, 10, 6]
    assert sorted(spread(list(range(100)), 100)) == list(range(100)) and spread([1, 2], 5) == [1, 2]
    first = spread(list(range(1000)), 100)[:4]
    assert max(first) - min(first) >= 500  # the first few span the list


def test_an_agents_next_turn_carries_its_calls_and_their_results():
    calls = [{"id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"id": None, "name": "book", "arguments": "{}"}]
    convo = followed([{"role": "user", "content": "hi"}], "", calls)
    assert [m["role"] for m in convo] == ["user", "assistant", "tool", "tool"]
    assert convo[1]["content"] is None
    assert [c["id"] for c in convo[1]["tool_calls"]] == ["call_a", "call_1"] == [m["tool_call_id"] for m in convo[2:]]
    assert json.loads(convo[2]["content"]) == {"tool": "get_weather", "status": "ok", "arguments_received": 16}


def test_answers_must_agree_across_levels_and_with_ar():
    reqs = [type("R", (), {"id": i})() for i in "ab"]
    same = {"ar": [{"clients": 1, "answers": ["x", "y"]}], "sf": [{"clients": 1, "answers": ["x", None]},
                                                                  {"clients": 4, "answers": ["x", "y"]}]}
    assert check_answers(same, reqs) == []
    same["sf"][1]["answers"][1] = "z"  # its only answer to b: AR's differs
    assert check_answers(same, reqs) == ["sf x4: b (differs from ar)"]
    same["sf"][1]["answers"][1], same["sf"][0]["answers"][0] = "y", "w"  # a at one client: AR's and its own later one
    assert check_answers(same, reqs) == ["sf x1: a (differs from ar)", "sf x4: a (differs from sf)"]


def test_clients_share_the_requests_and_their_answers_match_one_clients(busy, builtin_artifacts, tmp_path):  # noqa: F811
    engine, server = busy
    requests = read_requests(builtin_artifacts / "requests" / "bfcl450.jsonl")[0][::75][:5]
    before = prompt_counts(server.url, "eagle3")
    one = run_level(server.url, f"{MODEL}:eagle3", requests, 1)
    prompt, reused = (a - b for a, b in zip(prompt_counts(server.url, "eagle3"), before))
    assert prompt > 5 * 100 and 0 <= reused < prompt  # five prompts' tokens, some of them from kept prefixes
    three = run_level(server.url, f"{MODEL}:eagle3", requests, 3)
    for r in (one, three):
        assert not r["errors"] and all(a is not None for a in r["answers"])
        assert r["tokens"] > 0 and abs(r["tps"] * r["wall_s"] - r["tokens"]) < 0.01 * r["tokens"]  # over the wall time
        assert 0 < r["ttft_p50_s"] <= r["p50_s"] <= r["p95_s"] <= r["p99_s"] <= r["wall_s"]
    assert three["answers"] == one["answers"] and three["tokens"] == one["tokens"]
    rows = {"eagle3": [{k: v for k, v in r.items() if k != "answers"} for r in (one, three)]}
    plot(rows, tmp_path / "c.png", "test host")
    assert (tmp_path / "c.png").stat().st_size > 1000

    # a conversation the server continues after a call and its result
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = requests[0]
    convo = followed(r.messages, "", [{"id": None, "name": r.tools[0]["function"]["name"], "arguments": "{}"}])
    later = Turn(client, f"{MODEL}:ar", convo, r.tools)
    assert later.tokens > 0 and later.first is not None and not later.hung_up and later.finish in ("stop", "length", "tool_calls")

    # a quarter hanging up: the others answered as before, every request counted once
    reference = {m: {rq.id: (Turn(client, f"{MODEL}:{m}", rq.messages, rq.tools).answer,) for rq in requests[:2]}
                 for m in ("ar", "eagle3")}
    check = hangup_check(server.url, MODEL, ["ar", "eagle3"], requests[:2], 8, reference)
    assert check["hung_up"] == 2 and check["answered"] == 6 and not check["errors"], check
    assert not check["wrong"] and check["counted_once"], check
