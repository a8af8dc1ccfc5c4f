"""Concurrency bench: what each method gives many clients of one batching server at once, up
to saturation.

    python benchmarks/concurrency_bench.py [--limit 48] [--clients 1,2,4,8,16,32,64] [--methods ...]
                                           [--agents] [--turns 3] [--no-hangup]
                                           [--out outputs/bench/concurrency.json] [serve overrides ...]
    make bench-concurrency                 (AGENTS=1: agents' traffic)

Starts one server (``infer/serve.py``'s engine with every method in ``--methods``,
``max_batch`` = the most clients) and, for each number of clients and each method (methods
rotating, so a host that drifts shifts them alike), sends requests through the ``openai``
client, streamed, from that many threads, each taking the next request as soon as its last
one is answered. A level sends ``max(--limit, 2 × clients)`` requests (each client at least
two), the first of one list spread over the file, ordered so that every prefix of it is
spread too.

``--agents``: each client is an agent holding a conversation: it sends a request, answers
every tool call with a result, and sends the conversation again (the same tools, its earlier
calls and their results in the messages) until the model answers without a call or after
``--turns`` turns — what a server sees from agents, and where a prompt's prefix repeats.

Reports completion tokens per second over all clients, p50 / p95 / p99 request latency and
p50 / p95 time to the first token (the first streamed delta with text or a call), the share of
prompt tokens copied from kept prefixes instead of prefilled, each
method's ratio to its own one-client throughput and to AR at the same number of clients, and
checks that every answer equals the one the same method gave the same request at every other
level and (greedy) AR's. Then, at the most clients, every method's clients at once with a
quarter of them hanging up after their first delta: every other answer must equal its
reference, and the server must count each request once. What a method learns across requests
(suffix, ToolSpec) is forgotten before each run, so no run reads the answers of an earlier one.
Writes JSON and a plot beside it. Trailing arguments are Hydra overrides of the serve config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from infer import decoders
from infer.serving.app import serve_while
from infer.serving.engine import Engine
from schemafill import atomic
from schemafill.config import ServeConfig, compose_config
from schemafill.contract.records import read_requests, spread
from schemafill.runtime import host

METHODS = "ar,eagle3,ngram,suffix,toolspec,schemafill"
CLIENTS = "1,2,4,8,16,32,64"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 ≤ q ≤ 1) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def tool_result(name: str, arguments: str) -> str:
    """What an agent's tool returns in the bench: the same for every method, so conversations
    stay equal wherever their answers are."""
    return json.dumps({"tool": name, "status": "ok", "arguments_received": len(arguments)})


class Turn:
    """One streamed chat completion: its answer (content, calls), completion tokens, latency and
    time to the first token; ``hang_up`` leaves after the first delta with text or a call."""

    def __init__(self, client, model: str, messages: list, tools: list, hang_up: bool = False) -> None:
        t0 = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0
        content, calls = "", {}
        stream = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        self.hung_up = False
        self.finish: str | None = None
        for chunk in stream:
            if chunk.usage is not None:
                self.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                self.finish = choice.finish_reason or self.finish
                d = choice.delta
                if self.first is None and (d.content or d.tool_calls):
                    self.first = time.perf_counter() - t0
                    if hang_up:
                        stream.close()  # leaves with the response under way
                        self.hung_up = True
                        break
                content += d.content or ""
                for tc in d.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = tc.id or call["id"]
                    call["name"] += (tc.function and tc.function.name) or ""
                    call["arguments"] += (tc.function and tc.function.arguments) or ""
            if self.hung_up:
                break
        self.latency = time.perf_counter() - t0
        self.calls = [calls[i] for i in sorted(calls)]
        self.content = content
        self.answer = (content, tuple((c["name"], c["arguments"]) for c in self.calls))



def followed(messages: list, content: str, calls: list[dict]) -> list:
    """The conversation after an assistant turn that said ``content`` and made ``calls``
    (``{"id", "name", "arguments"}``): that turn, then each call's result."""
    ids = [c["id"] or f"call_{i}" for i, c in enumerate(calls)]
    assistant = {"role": "assistant", "content": content or None,
                 "tool_calls": [{"id": cid, "type": "function", "function": {"name": c["name"],
                                                                             "arguments": c["arguments"]}}
                                for cid, c in zip(ids, calls)]}
    results = [{"role": "tool", "tool_call_id": cid, "content": tool_result(c["name"], c["arguments"])}
               for cid, c in zip(ids, calls)]
    return [*messages, assistant, *results]


def run_level(url: str, model: str, requests: list, clients: int, turns: int = 1) -> dict:
    """``requests`` sent by ``clients`` threads at once (each request a conversation of up to
    ``turns`` turns); their answers (one per turn), latencies and the wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    answers: list = [None] * len(requests)
    latency: list[float] = []
    ttft: list[float] = []
    tokens, errors = [0] * len(requests), []
    lock, nxt = threading.Lock(), iter(range(len(requests)))

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            r = requests[i]
            messages, said = list(r.messages), []
            try:
                for _ in range(turns):
                    turn = Turn(client, model, messages, r.tools)
                    said.append(turn.answer)
                    tokens[i] += turn.tokens
                    with lock:
                        latency.append(turn.latency)
                        ttft.append(turn.first if turn.first is not None else turn.latency)
                    if not turn.calls or turn.finish != "tool_calls":  # no call, or one the length cap cut
                        break
                    messages = followed(messages, turn.content, turn.calls)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails at the end
                errors.append(f"{r.id}: {type(e).__name__}: {e}")
                continue
            answers[i] = tuple(said)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = latency or [0.0]
    return {"clients": clients, "requests": len(requests), "turns": len(latency), "tokens": sum(tokens),
            "wall_s": round(wall, 3), "tps": sum(tokens) / wall, "p50_s": statistics.median(lat),
            "p95_s": percentile(lat, 0.95), "p99_s": percentile(lat, 0.99),
            "ttft_p50_s": statistics.median(ttft or [0.0]), "ttft_p95_s": percentile(ttft or [0.0], 0.95),
            "errors": errors, "answers": answers}


def samples(url: str, name: str) -> list:
    """The samples named ``name`` on the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in family.samples if s.name == name]


def served_counts(url: str) -> dict[tuple[str, str], float]:
    """``schemafill_requests_total`` by (method, status)."""
    return {(s.labels["method"], s.labels["status"]): s.value for s in samples(url, "schemafill_requests_total")}


def prompt_counts(url: str, method: str) -> tuple[float, float]:
    """Prompt tokens ``method`` decoded so far, and how many of them it copied from kept prefixes."""
    return tuple(sum(s.value for s in samples(url, name) if s.labels["method"] == method)
                 for name in ("schemafill_prompt_tokens_total", "schemafill_prompt_tokens_reused_total"))


def hangup_check(url: str, name: str, methods: list[str], requests: list, clients: int, reference: dict) -> dict:
    """``clients`` streaming clients at once, method by client in turn, a quarter of them
    hanging up after their first delta: every other answer equals ``reference[method][id]``,
    and the server counts every request once (answered, or ended by its client)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    before = served_counts(url)
    results: list = [None] * clients
    barrier = threading.Barrier(clients)

    def one(i: int) -> None:
        m, r = methods[i % len(methods)], requests[i % len(requests)]
        barrier.wait()
        try:
            results[i] = Turn(client, f"{name}:{m}", r.messages, r.tools, hang_up=i % 4 == 3)
        except Exception as e:  # noqa: BLE001 - reported
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 60  # a hung-up request is counted once the server notices
    while time.time() < deadline:
        after = served_counts(url)
        ended = sum(after.get(k, 0) - before.get(k, 0) for k in after if k[1] in ("200", "499"))
        if ended >= clients:
            break
        time.sleep(0.5)
    errors = [f"client {i}: {type(x).__name__}: {x}" for i, x in enumerate(results) if isinstance(x, Exception)]
    wrong = [f"client {i} ({methods[i % len(methods)]}): {requests[i % len(requests)].id}"
             for i, x in enumerate(results) if isinstance(x, Turn) and not x.hung_up
             and (x.answer,) != reference[methods[i % len(methods)]].get(requests[i % len(requests)].id)]
    served = {status: sum(after.get((m, status), 0) - before.get((m, status), 0) for m in methods)
              for status in ("200", "499", "500", "503")}
    hung = sum(isinstance(x, Turn) and x.hung_up for x in results)
    return {"clients": clients, "answered": clients - hung - len(errors), "hung_up": hung, "served": served,
            "counted_once": served["200"] == clients - hung - len(errors) and served["200"] + served["499"] == clients,
            "errors": errors, "wrong": wrong}


def plot(result: dict, path: Path, host: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for m, runs in result.items():
        xs = [r["clients"] for r in runs]
        a.plot(xs, [r["tps"] for r in runs], marker="o", label=m)
        if any(r.get("over_ar") for r in runs):
            b.plot(xs, [r.get("over_ar") or 0 for r in runs], marker="o", label=m)
        c.plot(xs, [r["p95_s"] for r in runs], marker="o", label=m)
    b.axhline(1.0, color="grey", lw=0.8, ls="--")
    levels = sorted({r["clients"] for runs in result.values() for r in runs})
    for ax, title in ((a, "completion tokens / s, all clients"), (b, "× AR at the same clients"),
                      (c, "p95 request latency (s)")):
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(k) for k in levels])
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(f"one batching server, streamed — {host}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_answers(runs: dict[str, list[dict]], requests: list) -> list[str]:
    """Every answer equal to the same method's at every other level and, greedy, to AR's."""
    mismatches, seen = [], {}
    for m in sorted(runs, key=lambda m: m != "ar"):  # AR's answers first: the others are checked against them
        for r in runs[m]:
            for i, a in enumerate(r["answers"]):
                rid = requests[i].id
                if a is None:
                    continue
                for who in (m, "ar"):
                    if (who, rid) in seen and seen[(who, rid)] != a:
                        mismatches.append(f"{m} x{r['clients']}: {rid} (differs from {who})")
                        break
                seen.setdefault((m, rid), a)
    return mismatches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="artifacts/requests/bfcl450.jsonl")
    ap.add_argument("--limit", type=int, default=48,
                    help="requests a level sends at least (2 per client past that); a few times the clients, or\n"
                         "a run is one wave and its longest request, decoding alone at the end, sets its time")
    ap.add_argument("--clients", default=CLIENTS, help="numbers of concurrent clients")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--agents", action="store_true", help="each client an agent holding a multi-turn conversation")
    ap.add_argument("--turns", type=int, default=3, help="most turns of an agent's conversation (--agents)")
    ap.add_argument("--no-hangup", action="store_true", help="skip the run with a quarter of the clients hanging up")
    ap.add_argument("--out", default="outputs/bench/concurrency.json")
    args, overrides = ap.parse_known_args()
    methods, levels = args.methods.split(","), [int(k) for k in args.clients.split(",")]
    turns = args.turns if args.agents else 1
    most = max(levels)
    cfg = compose_config("serve", [f"method={methods[0]}", f"methods=[{','.join(methods[1:])}]",
                                   f"max_batch={most}", f"queue_size={most}", *overrides], ServeConfig)
    requests = spread(read_requests(args.requests)[0], max(args.limit, 2 * most))
    total = len(requests)
    sent = {k: min(total, max(args.limit, 2 * k)) for k in levels}
    engine = Engine(cfg)
    name = cfg.model.name
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    hangup: dict = {}

    def cold(method: str) -> None:
        """A run starts as on a fresh server: nothing learnt by the method, no prompt prefix kept
        (else every run after a level's first reuses its prompts and only that one prefills)."""
        decoders.reset(engine.decoders[method])
        if engine.batch.prefixes is not None:
            engine.batch.prefixes.clear()

    def drive(url: str) -> None:
        bar = tqdm(total=len(levels) * len(methods), desc="concurrency", unit="run", dynamic_ncols=True)
        for j, k in enumerate(levels):
            for m in methods[j % len(methods):] + methods[:j % len(methods)]:
                engine.between_rounds(lambda m=m: cold(m)).result()  # idle: no round
                before = prompt_counts(url, m)
                runs[m].append(run_level(url, f"{name}:{m}", requests[:sent[k]], k, turns))
                (prompt, reused), (prompt0, reused0) = prompt_counts(url, m), before
                runs[m][-1]["prompt_tokens"], runs[m][-1]["reused_tokens"] = prompt - prompt0, reused - reused0
                bar.set_postfix_str(f"{m} x{k}: {runs[m][-1]['tps']:.1f} tok/s")
                bar.update()
        bar.close()
        if not args.no_hangup and turns == 1:
            reference = {m: {requests[i].id: a for r in runs[m] for i, a in enumerate(r["answers"]) if a}
                         for m in methods}
            hangup.update(hangup_check(url, name, methods, requests[:sent[levels[0]]], most, reference))

    serve_while(engine, drive)  # clients on threads, the decode loop on this one, as ``infer/serve.py`` runs it

    mismatches = check_answers(runs, requests)
    errors = [e for rs in runs.values() for r in rs for e in r["errors"]]
    machine = host.summary()
    where = f"{machine['cpu_model']} ({machine['cpu_capability']}, {machine['torch_threads']} threads)"
    print(f"{'method':<11} {'clients':>7} {'tok/s':>7} {'x1 client':>9} {'xAR':>6} {'p50 s':>7} {'p95 s':>7} "
          f"{'p99 s':>7} {'TTFT50':>7} {'TTFT95':>7} {'reused':>7}")
    table = {}
    for m, rs in runs.items():
        table[m] = []
        for r in rs:
            ar = next((x for x in runs.get("ar", []) if x["clients"] == r["clients"]), None)
            row = {k: v for k, v in r.items() if k != "answers"}
            row["over_one_client"] = r["tps"] / rs[0]["tps"]
            row["over_ar"] = r["tps"] / ar["tps"] if ar else None
            table[m].append(row)
            xar = f"{row['over_ar']:6.2f}" if ar else "     -"
            print(f"{m:<11} {r['clients']:7d} {r['tps']:7.1f} {row['over_one_client']:9.2f} {xar} "
                  f"{r['p50_s']:7.2f} {r['p95_s']:7.2f} {r['p99_s']:7.2f} {r['ttft_p50_s']:7.2f} "
                  f"{r['ttft_p95_s']:7.2f} {r['reused_tokens'] / max(r['prompt_tokens'], 1):7.0%}")
    if hangup:
        print(f"hang-up run, {hangup['clients']} clients: {hangup['answered']} answered, {hangup['hung_up']} hung up, "
              f"served {hangup['served']}, each counted once: {hangup['counted_once']}, "
              f"answers that differ: {len(hangup['wrong'])}")
    out = Path(args.out)
    atomic.write_json(out, {"methods": table, "requests": [r.id for r in requests], "clients": levels,
                            "requests_per_level": sent, "agents": args.agents, "turns": turns,
                            "same_answers": not mismatches, "mismatches": mismatches, "errors": errors,
                            "hangup": hangup, "host": machine, "torch": torch.__version__,
                            "config": {"methods": methods, "max_batch": most, "overrides": overrides}})
    plot(table, out.with_suffix(".png"), where)
    print(f"[concurrency-bench] {total} requests ({sent} a level) at {levels} clients; host {where}; wrote {out} "
          f"and {out.with_suffix('.png')}")
    failed = mismatches or errors or (hangup and (hangup["wrong"] or hangup["errors"] or not hangup["counted_once"]))
    if failed:
        raise SystemExit(f"answers that differ ({mismatches[:3]}), errors ({errors[:3]}) or a hang-up run that lost "
                         f"or doubled a request ({ {k: hangup.get(k) for k in ('wrong', 'errors', 'served')} }): a bug")


if __name__ == "__main__":
    main()
