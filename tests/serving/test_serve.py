"""The OpenAI-compatible server, driven by the official ``openai`` client on a local port:
answers equal the CLI's, streamed equals whole, ``required`` always validates, bad input
gets a named 4xx and the server goes on, a bounded load loses nothing, and a client that
goes away frees its place. A tiny random target and head; real tokenizer, decoders, HTTP."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from infer.serving.app import BackgroundServer
from infer.serving.engine import Engine
from infer.serving.message import finish_reason, message
from infer.serving.protocol import parse_chat_request
from schemafill.config import InferConfig, ServeConfig, to_dataclass
from schemafill.contract.records import read_requests
from tests.conftest import compose
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)
from tests.serving.test_openai_message import assemble

MODEL = "smollm2-135m"
TARGET = ["model.finetune=false", "model.aux_layer_ids=[1,2,3]", "decode.max_new_tokens=24"]


@pytest.fixture(scope="module")
def served(tiny_target, tiny_head, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("serve")
    cfg = to_dataclass(compose([f"model.source={tiny_target}", f"head={tiny_head}", f"paths.artifacts={tmp}",
                                f"decode.cost_cache={tmp / 'cost'}", "methods=[ar,eagle3,ngram,suffix,toolspec]",
                                "max_batch=2", "queue_size=2", *TARGET],
                               config_name="serve"), ServeConfig)
    engine = Engine(cfg)
    with BackgroundServer(engine) as server:
        yield engine, server, tmp
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def requests(builtin_artifacts):
    return read_requests(builtin_artifacts / "requests" / "bfcl450.jsonl")[0][::90][:4]


def streamed(client, **kw):
    """What an application gets from a stream: the SDK's own accumulation of the chunks."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, chunks = ChatCompletionStreamState(), []
    for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        chunks.append(c)
        state.handle_chunk(c)
    return state.current_completion_snapshot, chunks  # (get_final_completion refuses a length-capped answer)


def calls_of(msg) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


def test_answers_equal_the_cli_token_for_token_streamed_or_not(served, client, requests, tiny_target, tiny_head,
                                                             tmp_path):  # noqa: F811
    from infer.run import run

    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in requests))
    cli = run(to_dataclass(compose([f"requests={path}", f"out={tmp_path / 'out'}", f"head={tiny_head}",
                                    f"model.source={tiny_target}", f"paths.artifacts={tmp_path}",
                                    f"decode.cost_cache={served[2] / 'cost'}", "methods=[ar,schemafill]",
                                    "warmup=0", *TARGET], config_name="infer"), InferConfig))["rows"]
    for method in ("schemafill", "ar"):
        for r, row in zip(requests, cli[method]):
            kw = dict(model=f"{MODEL}:{method}", messages=r.messages, tools=r.tools, temperature=0)
            whole = client.chat.completions.create(**kw)
            expected = message(row["text"], lambda i: "")
            assert whole.usage.completion_tokens == len(row["output_ids"])
            assert whole.usage.prompt_tokens == len(row["prompt_ids"]) and whole.usage.method == method
            assert whole.choices[0].message.content == expected.get("content")
            assert calls_of(whole.choices[0].message) == [(c["function"]["name"], c["function"]["arguments"])
                                                          for c in expected.get("tool_calls", [])]
            assert whole.choices[0].finish_reason == finish_reason(expected, row["stop"])
            final, chunks = streamed(client, **kw)
            assert final.choices[0].message.content == whole.choices[0].message.content
            assert calls_of(final.choices[0].message) == calls_of(whole.choices[0].message)
            assert final.choices[0].finish_reason == whole.choices[0].finish_reason
            assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert client.chat.completions.create(model=MODEL, messages=requests[0].messages).usage.method == "schemafill"


def test_required_and_named_tool_choice_always_validate_and_agree_across_methods(client, requests):
    for r in requests:
        answers = {}
        for method in ("ar", "schemafill", "eagle3"):
            for stream in (False, True):
                kw = dict(model=f"{MODEL}:{method}", messages=r.messages, tools=r.tools, tool_choice="required",
                          temperature=0, max_tokens=96)
                out = streamed(client, **kw)[0] if stream else client.chat.completions.create(**kw)
                answers[method, stream] = calls = calls_of(out.choices[0].message)
                # closing from max_tokens - decode.close_margin on: even a random target's call ends in time
                assert calls and out.choices[0].finish_reason == "tool_calls"
                schemas = {f["name"]: f.get("parameters") or {} for f in r.functions}
                for name, args in calls:  # a real call of a real tool, its arguments valid for its schema
                    jsonschema.validate(json.loads(args), schemas[name])
        assert len(set(map(tuple, answers.values()))) == 1  # lossless against constrained AR, streamed or not
        name = r.functions[-1]["name"]
        named = client.chat.completions.create(model=MODEL, messages=r.messages, tools=r.tools, temperature=0,
                                               tool_choice={"type": "function", "function": {"name": name}},
                                               max_tokens=96)
        assert {n for n, _ in calls_of(named.choices[0].message)} == {name}


def test_none_answers_content_and_sampling_is_seeded(client, requests):
    r = requests[0]
    free = client.chat.completions.create(model=MODEL, messages=r.messages, tools=r.tools, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=r.messages, tools=r.tools, tool_choice="none",
                                          temperature=0)
    assert none.choices[0].message.tool_calls is None and none.usage.completion_tokens == free.usage.completion_tokens
    # reproducible by seed under AR; speculative methods sample exactly the same distribution but
    # draw as their (learning) drafts dictate, so a seed does not pin their samples
    kw = dict(model=f"{MODEL}:ar", messages=r.messages, tools=r.tools, temperature=1.0, seed=7, max_tokens=12)
    a, b = (client.chat.completions.create(**kw) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens == 12
    assert client.chat.completions.create(**{**kw, "seed": 8}).choices[0].message.content != \
        a.choices[0].message.content


TRIP = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["city", "days", "tags"], "additionalProperties": False}
SPECULATIVE = ("schemafill", "eagle3", "ngram", "suffix", "toolspec")  # every lossless method but AR


def test_structured_outputs_follow_the_schema_and_equal_ar_whole_and_streamed(client, requests, smol_tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    for r in requests[:2]:
        answers = {}
        for method in ("ar", *SPECULATIVE):
            for stream in (False, True):
                kw = dict(model=f"{MODEL}:{method}", messages=r.messages, response_format=fmt, temperature=0,
                          max_tokens=64)
                out = streamed(client, **kw)[0] if stream else client.chat.completions.create(**kw)
                msg = out.choices[0].message
                assert msg.tool_calls is None and out.choices[0].finish_reason == "stop"
                jsonschema.validate(json.loads(msg.content), TRIP)  # the random target's answer, closed in time
                answers[method, stream] = msg.content
        assert len(set(answers.values())) == 1, answers  # lossless against constrained AR
    loose = client.chat.completions.create(model=MODEL, messages=requests[0].messages, temperature=0, max_tokens=32,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)
    # beside tools under tool_choice auto: the answer calls them or is the object, AR's either way
    kinds, r = set(), requests[0]
    schemas = {f["name"]: f.get("parameters") or {} for f in r.functions}
    key = smol_tokenizer('{"city"', add_special_tokens=False).input_ids[1:]
    for bias in ({}, {"logit_bias": {str(t): 100 for t in key}}):  # then toward the object's first key
        answers = set()
        for method in ("ar", *SPECULATIVE):
            kw = dict(model=f"{MODEL}:{method}", messages=r.messages, tools=r.tools, response_format=fmt,
                      temperature=0, max_tokens=64, **bias)
            msg = client.chat.completions.create(**kw).choices[0].message
            if msg.tool_calls:
                for c in msg.tool_calls:
                    jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            else:
                jsonschema.validate(json.loads(msg.content), TRIP)
            kinds.add("calls" if msg.tool_calls else "object")
            answers.add(msg.model_dump_json(exclude={"tool_calls": {"__all__": {"id"}}}))
        assert len(answers) == 1, answers
    assert kinds == {"calls", "object"}  # both ways out of the grammar were taken


def test_stop_logprobs_and_penalties_equal_ar_for_every_method_whole_and_streamed(client, requests):
    r = requests[1]
    base = dict(messages=r.messages, tools=r.tools, tool_choice="none", temperature=0, max_tokens=24)
    ar = client.chat.completions.create(model=f"{MODEL}:ar", **base).choices[0].message.content
    stop = ar[8:11]  # fires inside the answer, likely inside a block of accepted tokens
    cases = {"stop": dict(stop=[stop, "never said"]),
             "logprobs": dict(logprobs=True, top_logprobs=3),
             "penalties": dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"29": 5},
                               extra_body={"repetition_penalty": 1.3, "top_k": 5, "min_p": 0.05})}
    for name, extra in cases.items():
        seen = {}
        for method in ("ar", *SPECULATIVE):
            for stream in (False, True):
                kw = dict(model=f"{MODEL}:{method}", **base, **extra)
                if stream:
                    out, chunks = streamed(client, **kw)
                    scores = [e for c in chunks if c.choices and c.choices[0].logprobs
                              for e in c.choices[0].logprobs.content]
                else:
                    out = client.chat.completions.create(**kw)
                    scores = out.choices[0].logprobs.content if out.choices[0].logprobs else []
                seen[method, stream] = (out.choices[0].message.content, out.usage.completion_tokens,
                                        [(e.token, [t.token for t in e.top_logprobs]) for e in scores],
                                        [e.logprob for e in scores])
        text, tokens, top, lps = seen["ar", False]
        for key, (t, n, tp, lp) in seen.items():  # tokens equal; logprobs up to float noise of other shapes
            assert (t, n, tp) == (text, tokens, top), (name, key)
            assert lp == pytest.approx(lps, abs=1e-3), (name, key)
        if name == "stop":
            assert stop not in text and ar.startswith(text) and len(text) <= 8
        if name == "logprobs":
            assert len(top) == tokens and all(len(alts) == 3 for _, alts in top)
            assert all(lp <= 0 for lp in lps)
        if name == "penalties":
            assert text != ar  # the penalties changed the answer


BAD = [  # (body, status, param)
    (b"{not json", 400, None),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function.parameters"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {
        "type": "function", "function": {"name": "nope"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),  # over the context
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),  # lone surrogate
    (b"[" * 100000, 400, None),  # nested past the parser's recursion limit
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["a"],
                                                                      "required": ["a"]}}}]}, 400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 64}, 400, "seed"),
]


def post(url: str, body, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + "/v1/chat/completions", content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def test_bad_input_gets_a_named_4xx_and_the_server_goes_on(served, client, requests):
    url = served[1].url
    for body, status, param in BAD:
        res = post(url, body)
        assert res.status_code == status, res.text
        err = res.json()["error"]
        assert err["message"] and err["param"] == param
        assert client.chat.completions.create(model=MODEL, messages=requests[0].messages, max_tokens=4).usage
    assert "context_length_exceeded" in post(url, BAD[5][0]).text


def stream_post(url: str, body: dict) -> tuple[int, dict]:
    """A streamed request over raw HTTP: its status, and the answer its deltas assemble to."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as res:
        if res.status_code != 200:
            res.read()
            return res.status_code, res.json()
        deltas, ids = [], set()
        for line in res.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                ids.add(c["id"])
                deltas += [ch["delta"] for ch in c["choices"]]
        assert len(ids) == 1
        return 200, {"id": ids.pop(), "choices": [{"message": assemble(deltas)}]}


def metric(text: str, name: str, **labels) -> float:
    """A Prometheus sample's value, summed over the series whose labels include ``labels``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_bounded_load_answers_or_refuses_every_request_and_loses_none(served, client, requests):
    """8 clients x 4 requests at once against 2 decoding and 2 waiting, one in four streamed and one in
    four bad: each is answered (its own answer, as a lone request gets it), refused with 503, or
    refused as bad; none is lost."""
    url = served[1].url
    expected = {i: client.chat.completions.create(model=MODEL, messages=r.messages, tools=r.tools,
                                                  max_tokens=16).choices[0].message.model_dump()
                for i, r in enumerate(requests)}
    before = httpx.get(url + "/metrics").text
    results, barrier = [], threading.Barrier(8)

    def worker(w: int) -> None:
        barrier.wait()
        for j in range(4):
            k = (w * 4 + j) % len(requests)
            if j == 3:
                results.append(("bad", post(url, BAD[w % len(BAD)][0]).status_code, None))
                continue
            r = requests[k]
            body = {"model": MODEL, "messages": r.messages, "tools": r.tools, "max_tokens": 16}
            if j == 1:  # streamed: refused with a 503 status too, never a 200 stream that fails
                results.append((k, *stream_post(url, body)))
            else:
                res = post(url, body)
                results.append((k, res.status_code, {**res.json(), "retry_after": res.headers.get("retry-after")}))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 32
    ok = [(k, body) for k, status, body in results if status == 200]
    busy = [body for k, status, body in results if status == 503]
    bad = [status for k, status, _ in results if k == "bad"]
    print(f"load: {len(ok)} answered, {len(busy)} refused 503, {len(bad)} bad refused 4xx")
    assert len(ok) + len(busy) + len(bad) == 32 and ok and busy and all(400 <= s < 500 for s in bad)
    assert all(b["error"]["code"] == "server_busy" for b in busy)
    assert all(b["retry_after"] == "1" for b in busy if "retry_after" in b)  # a 503 says when to come back
    for k, body in ok:  # each its own answer: nothing mixed up between concurrent requests
        assert body["choices"][0]["message"]["content"] == expected[k]["content"]
    assert len({body["id"] for _, body in ok}) == len(ok)
    after = httpx.get(url + "/metrics").text
    for status, n in (("200", len(ok)), ("503", len(busy))):
        assert metric(after, "schemafill_requests_total", status=status) - \
            metric(before, "schemafill_requests_total", status=status) == n
    assert httpx.get(url + "/health").json()["outstanding"] == 0
    assert client.chat.completions.create(model=MODEL, messages=requests[0].messages, max_tokens=4).usage


def test_a_client_that_goes_away_frees_its_place(served, requests):
    """A long decode whose client hangs up (mid-stream, or waiting for a whole answer) stops
    at its next round: the server is idle again long before the decode would have ended."""
    engine, server, _ = served
    url = server.url
    long = {"model": f"{MODEL}:ar", "messages": requests[0].messages, "max_tokens": 1500, "temperature": 0}
    for stream in (True, False):
        before = metric(httpx.get(url + "/metrics").text, "schemafill_requests_total", status="499")
        tokens = metric(httpx.get(url + "/metrics").text, "schemafill_completion_tokens_total", method="ar")
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60) as res:
                lines = res.iter_lines()
                assert next(lines).startswith("data: ")  # the stream has begun; then the client hangs up
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/chat/completions", json=long, timeout=httpx.Timeout(60, read=0.5))
        deadline = time.time() + 20
        while engine.outstanding and time.time() < deadline:
            time.sleep(0.05)
        assert engine.outstanding == 0
        text = httpx.get(url + "/metrics").text
        assert metric(text, "schemafill_requests_total", status="499") == before + 1
        assert metric(text, "schemafill_completion_tokens_total", method="ar") == tokens  # never finished


def test_models_health_and_metrics(served, client):
    url = served[1].url
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, *(f"{MODEL}:{m}" for m in ("schemafill", "ar", "eagle3", "ngram", "suffix", "toolspec"))]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    text = httpx.get(url + "/metrics").text
    for name in ("schemafill_requests_total", "schemafill_completion_tokens_total", "schemafill_target_calls_total",
                 "schemafill_accept_length_bucket", "schemafill_request_seconds_bucket", "schemafill_queue_depth",
                 "schemafill_batch_size_bucket", "schemafill_round_rows_bucket"):
        assert name in text
    assert metric(text, "schemafill_completion_tokens_total", method="schemafill") > 0


def test_help_names_the_endpoints_and_the_knobs():
    import subprocess
    import sys

    from tests.conftest import ROOT

    helped = subprocess.run([sys.executable, "infer/serve.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0, helped.stderr[-2000:]
    for words in ("POST /v1/chat/completions", "GET  /metrics", "queue_size", "max_batch", "tool_choice: auto",
                  "port: 8000"):
        assert words in helped.stdout


def test_a_method_that_is_not_lossless_is_refused_before_any_model_loads(tmp_path):
    cfg = to_dataclass(compose(["method=parallel_fill", f"paths.artifacts={tmp_path}"], config_name="serve"),
                       ServeConfig)
    with pytest.raises(ValueError, match="not lossless"):
        Engine(cfg)
    with pytest.raises(ValueError, match="unknown method"):
        Engine(to_dataclass(compose(["method=medusa"], config_name="serve"), ServeConfig))


def test_a_hermes_target_is_served_in_its_own_format(tiny_target, tiny_head, requests, tmp_path):
    """The server reads and writes the target's format: earlier assistant calls go back into the
    prompt as hermes blocks, and tool_choice required holds it to a hermes call by the hermes
    grammar."""
    cfg = to_dataclass(compose([f"model.source={tiny_target}", f"head={tiny_head}", f"paths.artifacts={tmp_path}",
                                f"decode.cost_cache={tmp_path / 'cost'}", "method=ar", "warmup=false",
                                "model.response_format=hermes", *TARGET], config_name="serve"), ServeConfig)
    engine = Engine(cfg)
    try:
        with BackgroundServer(engine) as server:
            tools = requests[0].tools
            name = tools[0]["function"]["name"]
            history = [*requests[0].messages,
                       {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function",
                                                             "function": {"name": name, "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c0", "content": "done"}]
            body = {"model": MODEL, "messages": history, "tools": tools, "max_tokens": 4}
            assert post(server.url, body).status_code == 200
            chat = parse_chat_request(body, engine.models, "id", 0.0, engine.fmt)
            assert chat.request.messages[-2] == {"role": "assistant", "content": engine.fmt.serialize(
                [{"name": name, "arguments": {}}])}  # the earlier call, as the target writes calls
            assert chat.request.messages[-2]["content"].startswith("<tool_call>\n{")
            # tool_choice required under the hermes grammar: the random target writes a hermes call
            forced = post(server.url, {"model": MODEL, "messages": requests[0].messages, "tools": tools,
                                       "tool_choice": "required", "max_tokens": 160})
            choice = forced.json()["choices"][0]
            assert forced.status_code == 200 and choice["finish_reason"] == "tool_calls", choice
            call = choice["message"]["tool_calls"][0]["function"]
            assert call["name"] in {t["function"]["name"] for t in tools} and isinstance(json.loads(call["arguments"]),
                                                                                         dict)
    finally:
        engine.close()
