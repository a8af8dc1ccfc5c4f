"""The batching server under load: 64 streaming clients at once, a quarter of them hanging up
mid-stream. Every other request is answered in full, exactly as it is answered alone, or
refused with 503 and a ``Retry-After``; afterwards the server is idle, healthy, and holds no
request's state. A tiny random target and head; real tokenizer, decoders, HTTP."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from infer.serving.app import BackgroundServer
from infer.serving.engine import Engine
from schemafill.config import ServeConfig, to_dataclass
from schemafill.contract.records import read_requests
from tests.conftest import compose
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)
from tests.serving.test_openai_message import assemble
from tests.serving.test_serve import MODEL, TARGET, metric

CLIENTS = 64


def sample(text: str, name: str) -> float:
    """An unlabelled Prometheus sample's value."""
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def busy(tiny_target, tiny_head, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("load")
    cfg = to_dataclass(compose([f"model.source={tiny_target}", f"head={tiny_head}", f"paths.artifacts={tmp}",
                                f"decode.cost_cache={tmp / 'cost'}", "methods=[ar,eagle3]", "max_batch=8",
                                "queue_size=16", "prefill_tokens=64", *TARGET], config_name="serve"), ServeConfig)
    engine = Engine(cfg)
    with BackgroundServer(engine) as server:
        yield engine, server
    engine.close()


def stream(url: str, body: dict, hang_up: bool) -> tuple[int, dict | None, str | None]:
    """Status, the assembled answer (None for a client that hung up after its first delta),
    and the ``Retry-After`` of a refusal."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as res:
        if res.status_code != 200:
            res.read()
            return res.status_code, res.json(), res.headers.get("retry-after")
        deltas, finished = [], False
        for line in res.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                deltas += [ch["delta"] for ch in c["choices"]]
                if hang_up and any(d.get("content") or d.get("tool_calls") for d in deltas):
                    return 200, None, None  # leaves with the stream open
                finished = finished or any(ch.get("finish_reason") for ch in c["choices"])
        assert finished
        return 200, assemble(deltas), None


def test_64_streaming_clients_a_quarter_hanging_up_lose_nothing_and_none_is_answered_twice(busy, builtin_artifacts):
    engine, server = busy
    url = server.url
    requests = read_requests(builtin_artifacts / "requests" / "bfcl450.jsonl")[0][::40][:6]
    methods = [MODEL, f"{MODEL}:ar", f"{MODEL}:eagle3"]
    bodies = [{"model": methods[i % 3], "messages": requests[i % len(requests)].messages,
               "tools": requests[i % len(requests)].tools, "max_tokens": 24, "temperature": 0} for i in range(CLIENTS)]
    alone = {}  # each (method, request) answered with nothing else decoding: batch 1
    for i, body in enumerate(bodies[:18]):
        status, answer, _ = stream(url, body, hang_up=False)
        assert status == 200
        alone[(body["model"], i % len(requests))] = answer
    before, rss = httpx.get(url + "/metrics").text, rss_mb()
    results: list = [None] * CLIENTS
    barrier = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = stream(url, bodies[i], hang_up=i % 4 == 3)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(r is not None for r in results)
    answered = refused = hung_up = 0
    for i, (status, answer, retry) in enumerate(results):
        if status == 503:
            assert answer["error"]["code"] == "server_busy" and retry == "1"
            refused += 1
        elif answer is None:
            hung_up += 1
        else:
            assert status == 200
            assert answer == alone[(bodies[i]["model"], i % len(requests))], i  # whatever it was batched with
            answered += 1
    print(f"load: {answered} answered in full, {hung_up} hung up, {refused} refused")
    assert answered and refused and answered + hung_up + refused == CLIENTS
    assert answered + hung_up >= engine.cfg.max_batch + engine.cfg.queue_size  # every place was used
    deadline = time.time() + 30  # a hung-up request is counted once the server notices
    while time.time() < deadline:
        after = httpx.get(url + "/metrics").text
        counted = {status: metric(after, "schemafill_requests_total", status=status) -
                   metric(before, "schemafill_requests_total", status=status) for status in ("200", "499", "503")}
        if counted["499"] >= hung_up:
            break
        time.sleep(0.2)
    assert counted == {"200": answered, "499": hung_up, "503": refused}  # each request once, as what became of it
    rounds, requests_in_rounds = (sample(after, f"schemafill_batch_size_{k}") - sample(before, f"schemafill_batch_size_{k}")
                                  for k in ("count", "sum"))
    assert requests_in_rounds / rounds > 2  # requests shared their rounds' forwards
    assert metric(after, "schemafill_batch_size_bucket", le=f"{engine.cfg.max_batch}.0") == \
        sample(after, "schemafill_batch_size_count")  # never more than max_batch in one
    assert sample(after, "schemafill_round_rows_count") - sample(before, "schemafill_round_rows_count") == rounds
    # idle and healthy: no request's state is left, and a new request is answered as before
    deadline = time.time() + 30
    while engine.outstanding and time.time() < deadline:
        time.sleep(0.05)
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["outstanding"] == 0 and health["decoding"] == 0
    assert not engine.batch.streams and not engine._jobs and not engine._waiting and not engine._live
    assert stream(url, bodies[0], hang_up=False)[1] == alone[(bodies[0]["model"], 0)]
    assert rss_mb() - rss < 400  # bounded: the batch's arenas went with their requests
