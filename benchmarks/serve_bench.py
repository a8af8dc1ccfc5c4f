"""Serve bench: what the HTTP path costs over decoding in-process, per method, same requests.

    python benchmarks/serve_bench.py [--limit 12] [--out outputs/serve_bench.json] [serve overrides ...]
    make serve-bench

Loads one server (``infer/serve.py``'s engine, every method in ``--methods``, its decode loop
on the main thread as the server runs it) and, request by request and method by method
(interleaved, so a host that drifts shifts both paths alike), decodes each request twice:
in-process on that same loop's thread the way ``infer/run.py`` times it (prompt rendering
through stop), and through ``POST /v1/chat/completions`` with the ``openai``
client, non-streamed and streamed (first token and end to end). Prints per method the
tokens/s of both paths, their ratio and the mean overhead in ms per request, checks that
both paths returned the same tokens, and writes JSON. Trailing arguments are Hydra
overrides of the serve config (e.g. ``model=...``, ``head=...``, ``decode=paper``).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from infer.rounds.decoding import DecodeOptions
from infer.rounds.sampling import Sampler
from infer.serving.app import serve_while
from infer.serving.engine import Engine
from infer.serving.message import message
from schemafill import atomic
from schemafill.config import ServeConfig, compose_config
from schemafill.contract.records import evenly, read_requests
from schemafill.runtime import host


def bench(engine: Engine, requests: list, methods: list[str]) -> dict:
    """HTTP and the server on threads, the engine's decode loop on this one (as ``infer/serve.py``
    runs it); the in-process decodes go to that loop too, so both paths decode on one thread."""
    return _summary(serve_while(engine, lambda url: _drive(engine, url, requests, methods)))


def _drive(engine: Engine, url: str, requests: list, methods: list[str]) -> dict[str, list[dict]]:
    from openai import OpenAI

    rows: dict[str, list[dict]] = defaultdict(list)
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    name = engine.cfg.model.name
    bar = tqdm(total=len(requests) * len(methods), desc="serve-bench", unit="decode x3", dynamic_ncols=True)
    for i, r in enumerate(requests):
        for m in methods[i % len(methods):] + methods[:i % len(methods)]:
            decode = (lambda m=m, r=r: _timed(lambda: engine.decoders[m].decode(
                r, engine.prompt(r), DecodeOptions(Sampler(0.0, 1.0, 0)))))
            decoded, direct = engine.between_rounds(decode).result()  # timed on the decode loop's thread
            kw = dict(model=f"{name}:{m}", messages=r.messages, tools=r.tools, temperature=0)
            t0 = time.perf_counter()
            answer = client.chat.completions.create(**kw)
            http = time.perf_counter() - t0
            t0, first = time.perf_counter(), None
            for chunk in client.chat.completions.create(stream=True, **kw):
                if first is None and chunk.choices and (chunk.choices[0].delta.content or
                                                        chunk.choices[0].delta.tool_calls):
                    first = time.perf_counter() - t0
            streamed = time.perf_counter() - t0
            got, want = answer.choices[0].message, message(decoded.text, lambda k: "")
            same = answer.usage.completion_tokens == len(decoded.ids) and got.content == want.get("content") \
                and [(c.function.name, c.function.arguments) for c in got.tool_calls or []] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in want.get("tool_calls", [])]
            rows[m].append({"id": r.id, "tokens": len(decoded.ids), "direct_s": direct, "http_s": http,
                            "stream_s": streamed, "first_s": first, "same": same})
            bar.update()
    bar.close()
    return rows


def _timed(fn):
    """``fn()`` and its seconds."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _summary(rows: dict) -> dict:
    out = {}
    for m, rs in rows.items():
        tokens = sum(x["tokens"] for x in rs)
        direct, http, stream = (sum(x[k] for x in rs) for k in ("direct_s", "http_s", "stream_s"))
        firsts = [x["first_s"] for x in rs if x["first_s"] is not None]
        out[m] = {"requests": len(rs), "tokens": tokens, "direct_tps": tokens / direct, "http_tps": tokens / http,
                  "stream_tps": tokens / stream, "http_over_direct": direct / http,
                  "overhead_ms": 1e3 * (http - direct) / len(rs), "stream_overhead_ms": 1e3 * (stream - direct) / len(rs),
                  "mean_first_token_s": sum(firsts) / len(firsts) if firsts else None,
                  "same_tokens": all(x["same"] for x in rs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="artifacts/requests/bfcl450.jsonl")
    ap.add_argument("--limit", type=int, default=12, help="requests, spread evenly over the file")
    ap.add_argument("--methods", default="ar,eagle3,schemafill")
    ap.add_argument("--out", default="outputs/serve_bench.json")
    args, overrides = ap.parse_known_args()
    methods = args.methods.split(",")
    cfg = compose_config("serve", [f"method={methods[0]}", f"methods=[{','.join(methods[1:])}]", *overrides],
                         ServeConfig)
    requests = read_requests(args.requests)[0]
    requests = evenly(requests, args.limit)
    engine = Engine(cfg)
    try:
        result = bench(engine, requests, methods)
    finally:
        engine.close()
    print(f"{'method':<12} {'direct tok/s':>12} {'HTTP tok/s':>11} {'stream tok/s':>12} {'HTTP/direct':>11} "
          f"{'overhead ms':>11} {'1st token s':>11} {'same':>5}")
    for m, v in result.items():
        first = f"{v['mean_first_token_s']:11.2f}" if v["mean_first_token_s"] is not None else "          -"
        print(f"{m:<12} {v['direct_tps']:12.1f} {v['http_tps']:11.1f} {v['stream_tps']:12.1f} "
              f"{v['http_over_direct']:11.3f} {v['overhead_ms']:11.1f} {first} {str(v['same_tokens']):>5}")
    machine = host.summary()
    print(f"[serve-bench] {len(requests)} requests; host {machine['cpu_model']} ({machine['cpu_capability']}, "
          f"{machine['torch_threads']} threads); wrote {args.out}")
    atomic.write_json(args.out, {"methods": result, "requests": len(requests), "host": machine,
                                 "torch": torch.__version__, "config": {"methods": methods, "overrides": overrides}})
    if not all(v["same_tokens"] for v in result.values()):
        raise SystemExit("the HTTP path returned other tokens than the in-process decode: a bug")


if __name__ == "__main__":
    main()
