"""Concurrency bench: what each method gives many clients of one batching server at once.

    python benchmarks/concurrency_bench.py [--limit 48] [--clients 1,4,8,16] [--methods ...]
                                           [--out outputs/bench/concurrency.json] [serve overrides ...]
    make bench-concurrency

Starts one server (``infer/serve.py``'s engine with every method in ``--methods``,
``max_batch`` = the most clients) and, for each number of clients and each method (methods
rotating, so a host that drifts shifts them alike), sends the same ``--limit`` requests
through the ``openai`` client from that many threads, each taking the next request as soon as
its last one is answered. Reports completion tokens per second over all clients, p50 / p95
request latency, each method's ratio to its own one-client throughput and to AR at the same
number of clients, and checks that every answer equals the one the same method gave with one
client (and, greedy, AR's). What a method learns across requests (suffix, ToolSpec) is
forgotten before each run, so no run reads the answers of an earlier one. Writes JSON and a
plot beside it. Trailing arguments are Hydra overrides of the serve config.
"""

from __future__ import annotations

import argparse
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
from schemafill.contract.records import read_requests
from schemafill.runtime import host

METHODS = "ar,eagle3,ngram,suffix,toolspec,schemafill"


def answer_of(choice) -> tuple:
    msg = choice.message
    return msg.content, tuple((c.function.name, c.function.arguments) for c in msg.tool_calls or [])


def run_level(url: str, model: str, requests: list, clients: int) -> dict:
    """``requests`` sent by ``clients`` threads at once; their answers, latencies and the wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    answers, latency, tokens, errors = [None] * len(requests), [0.0] * len(requests), [0] * len(requests), []
    lock, nxt = threading.Lock(), iter(range(len(requests)))

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            r = requests[i]
            t0 = time.perf_counter()
            try:
                res = client.chat.completions.create(model=model, messages=r.messages, tools=r.tools, temperature=0)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails at the end
                errors.append(f"{r.id}: {type(e).__name__}: {e}")
                continue
            latency[i] = time.perf_counter() - t0
            answers[i], tokens[i] = answer_of(res.choices[0]), res.usage.completion_tokens

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = sorted(latency)
    return {"clients": clients, "tokens": sum(tokens), "wall_s": round(wall, 3), "tps": sum(tokens) / wall,
            "p50_s": statistics.median(lat), "p95_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
            "errors": errors, "answers": answers}


def plot(result: dict, path: Path, host: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m, runs in result.items():
        xs = [r["clients"] for r in runs]
        a.plot(xs, [r["tps"] for r in runs], marker="o", label=m)
        b.plot(xs, [r["p95_s"] for r in runs], marker="o", label=m)
    levels = sorted({r["clients"] for runs in result.values() for r in runs})
    for ax, title in ((a, "completion tokens / s, all clients"), (b, "p95 request latency (s)")):
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(k) for k in levels])
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(f"one batching server, same requests at every level — {host}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="artifacts/requests/bfcl450.jsonl")
    ap.add_argument("--limit", type=int, default=48,
                    help="requests, spread evenly over the file; a few times the most clients, or a run is one\n"
                         "wave of requests and its longest request, decoding alone at the end, sets its time")
    ap.add_argument("--clients", default="1,4,8,16", help="numbers of concurrent clients")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--out", default="outputs/bench/concurrency.json")
    args, overrides = ap.parse_known_args()
    methods, levels = args.methods.split(","), [int(k) for k in args.clients.split(",")]
    most = max(levels)
    cfg = compose_config("serve", [f"method={methods[0]}", f"methods=[{','.join(methods[1:])}]",
                                   f"max_batch={most}", f"queue_size={most}", *overrides], ServeConfig)
    requests = read_requests(args.requests)[0]
    requests = [requests[i * len(requests) // args.limit] for i in range(min(args.limit, len(requests)))]
    engine = Engine(cfg)
    name = cfg.model.name
    runs: dict[str, list[dict]] = {m: [] for m in methods}

    def drive(url: str) -> None:
        bar = tqdm(total=len(levels) * len(methods), desc="concurrency", unit="run", dynamic_ncols=True)
        for j, k in enumerate(levels):
            for m in methods[j % len(methods):] + methods[:j % len(methods)]:
                engine.between_rounds(lambda m=m: decoders.reset(engine.decoders[m])).result()  # idle: no round
                runs[m].append(run_level(url, f"{name}:{m}", requests, k))
                bar.set_postfix_str(f"{m} x{k}: {runs[m][-1]['tps']:.1f} tok/s")
                bar.update()
        bar.close()

    serve_while(engine, drive)  # clients on threads, the decode loop on this one, as ``infer/serve.py`` runs it

    # every answer as the same method gave it to one client, and (greedy) as AR did
    reference = {m: rs[0]["answers"] for m, rs in runs.items()}
    mismatches = [f"{m} x{r['clients']}: {requests[i].id}" for m, rs in runs.items() for r in rs
                  for i, a in enumerate(r["answers"]) if a != reference[m][i]
                  or "ar" in reference and a != reference["ar"][i]]
    errors = [e for rs in runs.values() for r in rs for e in r["errors"]]
    machine = host.summary()
    where = f"{machine['cpu_model']} ({machine['cpu_capability']}, {machine['torch_threads']} threads)"
    print(f"{'method':<11} {'clients':>7} {'tok/s':>7} {'x1 client':>9} {'xAR':>6} {'p50 s':>7} {'p95 s':>7}")
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
                  f"{r['p50_s']:7.2f} {r['p95_s']:7.2f}")
    out = Path(args.out)
    atomic.write_json(out, {"methods": table, "requests": [r.id for r in requests], "clients": levels,
                            "same_answers": not mismatches, "mismatches": mismatches, "errors": errors,
                            "host": machine, "torch": torch.__version__,
                            "config": {"methods": methods, "max_batch": most, "overrides": overrides}})
    plot(table, out.with_suffix(".png"), where)
    print(f"[concurrency-bench] {len(requests)} requests at {levels} clients; host {where}; wrote {out} and "
          f"{out.with_suffix('.png')}")
    if mismatches or errors:
        raise SystemExit(f"answers that differ from one client's ({mismatches[:3]}) or errors ({errors[:3]}): a bug")


if __name__ == "__main__":
    main()
