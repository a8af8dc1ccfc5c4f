"""Project a CPU bench onto a device: each method's own call shapes, replayed on a
7B-shaped random target and head, give the TPS it would reach there against AR.

    python benchmarks/gpu_project.py --bench outputs/bench30 [--shape qwen2.5-7b|tiny] [--out FILE]

Reads ``<bench>/outputs/<method>.jsonl`` as ``infer/run.py`` writes it: per request the rows
and milliseconds of every target call (the prefill first), the EAGLE-3 head's forwards and
their milliseconds, the request's seconds and its tokens. Per request and method:

* **target** — Σ c_dev(rows) over its calls, c_dev timed on the device: the prefill at the
  prompt's length, a verification at the bench's mean prompt length plus half its mean
  response, each distinct row count bucketed up to a power of two;
* **head** — its forwards × one head forward of the 7B shape on the device;
* **host** — what the CPU run spent outside the target and the head (seconds − Σ call ms − head
  ms): Python, packing, parsing, selection; the same code runs on a GPU's host, shown apart
  because on a device it is the part that does not shrink. With ``--host`` (the JSON of
  ``gpu_check.py --lossless`` run on the device) each method's host milliseconds per call
  measured on the device's host replace the CPU's, for the methods it ran.

The costs are the default path's on the device: on CUDA the calls and head forwards replay CUDA
graphs (``schemafill.runtime.backends.cuda_graphs``; a prefill past the largest row bucket runs eagerly).

The acceptance profile — how many calls, of how many rows, for how many tokens — is the CPU
run's, with the trees a CPU's costs chose. Selection on the device would keep more rows
(they cost little there), so the projection understates what speculation gains on it; host
time measured on 2 cores may also shrink on a server CPU. Everything it times runs on
``--shape tiny`` on a CPU in seconds (the test), so CI never needs a device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu_check import SHAPES, build
from schemafill import atomic
from schemafill.runtime import backends
from schemafill.runtime.device import resolve_device, resolve_dtype
from schemafill.runtime.model import Target
from schemafill.runtime.timing import median_ms


def read_bench(folder: Path) -> dict[str, list[dict]]:
    """Method -> its rows of ``<folder>/outputs/<method>.jsonl`` (those that recorded call shapes)."""
    out = {}
    for path in sorted((folder / "outputs").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("call_rows")]
        if rows:
            out[path.stem] = rows
    if not out:
        raise FileNotFoundError(f"no call shapes under {folder / 'outputs'}: run infer/run.py there first "
                                f"(an infer/run.py of this version records each call's rows)")
    return out


def bucket(n: int) -> int:
    """The row count a call is timed at: the power of two at or above it."""
    return 1 << max(n - 1, 0).bit_length()


@torch.inference_mode()
def target_costs(target: Target, context: int, rows: list[int], prompts: list[int], repeats: int
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """ms of a verification of each row count after ``context`` positions, and of a prefill of each prompt length."""
    dev, vocab = target.device, target.config.vocab_size
    width = max(context + max(rows), max(prompts))
    arena = target.new_arena(1, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None]
    pos = torch.arange(width, device=dev)[None]
    ids = torch.randint(0, vocab, (1, width), device=dev)
    prefill = {p: median_ms(lambda p=p: target(ids[:, :p], pos[:, :p], causal[:, :p, :p], pos[:, :p], arena,
                                           logits_at=torch.tensor([[p - 1]], device=dev)), dev, repeats)
               for p in prompts}
    target(ids[:, :context], pos[:, :context], causal[:, :context, :context], pos[:, :context], arena)
    verify = {}
    for n in rows:
        sl = slice(context, context + n)
        verify[n] = median_ms(lambda sl=sl: target(ids[:, sl], pos[:, sl], causal[:, sl, :sl.stop], pos[:, sl], arena),
                          dev, repeats)
    return verify, prefill


@torch.inference_mode()
def head_cost(head, target: Target, repeats: int) -> float:
    """ms of one head forward (4 rows: a catch-up or a level) with its draft logits."""
    dev, h = target.device, target.config.hidden_size
    arena = head.new_arena(64)
    n = 4
    pos = torch.arange(n, device=dev)[None]
    vis = torch.ones(1, n, n, dtype=torch.bool, device=dev).tril()
    hidden = torch.randn(1, n, h, device=dev, dtype=target.dtype)
    tokens = torch.randint(0, target.config.vocab_size, (1, n), device=dev)
    return median_ms(lambda: head.logits(head.decode_step(tokens, hidden, pos, vis, pos, arena)[0]), dev, repeats)


def project(bench: dict[str, list[dict]], verify: dict[int, float], prefill: dict[int, float], head_ms: float,
            host_ms: dict[str, float] | None = None) -> dict[str, dict]:
    """Per method: tokens, the projected seconds split into target / head / host, TPS and × AR.
    ``host_ms``: a method's host milliseconds per call measured on the device, in place of the CPU run's."""
    lengths = sorted(prefill)

    def prefill_ms(p: int) -> float:  # linear between the timed lengths
        hi = next((q for q in lengths if q >= p), lengths[-1])
        lo = max((q for q in lengths if q <= p), default=lengths[0])
        return prefill[lo] if hi == lo else prefill[lo] + (prefill[hi] - prefill[lo]) * (p - lo) / (hi - lo)

    out = {}
    for method, rows in bench.items():
        target = head = host = 0.0
        tokens = sum(len(r["output_ids"]) for r in rows)
        for r in rows:
            first, *calls = r["call_rows"]
            target += prefill_ms(first) + sum(verify[bucket(n)] for n in calls)
            head += r.get("head_forwards", 0) * head_ms
            if host_ms and method in host_ms:
                host += host_ms[method] * len(r["call_rows"])
            else:
                host += max(1e3 * r["seconds"] - sum(r["call_ms"]) - r.get("head_ms", 0.0), 0.0)
        seconds = (target + head + host) / 1e3
        out[method] = {"tokens": tokens, "target_s": round(target / 1e3, 3), "head_s": round(head / 1e3, 3),
                       "host_s": round(host / 1e3, 3),
                       "host_ms_per_call": round(host / sum(len(r["call_rows"]) for r in rows), 2),
                       "host_measured_on": "device" if host_ms and method in host_ms else "cpu",
                       "tps": round(tokens / seconds, 2), "cpu_tps": round(tokens / sum(r["seconds"] for r in rows), 2)}
    if "ar" in out:
        for v in out.values():
            v["x_ar"] = round(v["tps"] / out["ar"]["tps"], 3)
            v["cpu_x_ar"] = round(v["cpu_tps"] / out["ar"]["cpu_tps"], 3)
    return out


def device_host_ms(path: str | None) -> dict[str, float] | None:
    """Per method, host ms per call from ``gpu_check.py --lossless``'s JSON (its bf16 run, the
    device's precision), or None without one."""
    if path is None:
        return None
    report = json.loads(Path(path).read_text())
    runs = report.get("bfloat16") or report.get("float32") or {}
    return {m: v["host_ms_per_call"] for m, v in runs.items() if v.get("host_ms_per_call") is not None}


def run(bench_dir: str, shape: str = "qwen2.5-7b", repeats: int = 5, host: str | None = None) -> dict:
    bench = read_bench(Path(bench_dir))
    device = resolve_device()
    dtype = resolve_dtype("auto", device)
    all_rows = [r for rows in bench.values() for r in rows]
    prompt = statistics.fmean(len(r["prompt_ids"]) for r in all_rows)
    answer = statistics.fmean(len(r["output_ids"]) for r in all_rows)
    context = int(prompt + answer / 2)
    sizes = sorted({bucket(n) for r in all_rows for n in r["call_rows"][1:]})
    prefills = sorted({64 * -(-r["call_rows"][0] // 64) for r in all_rows})  # each rounded up to 64 rows
    prompts = sorted(set(prefills[:: max(1, len(prefills) // 6)] + [prefills[-1]]))  # at most ~7 timed
    started = time.perf_counter()
    target, head = build(shape, device, dtype)
    backends.attach(target, "auto")  # the default path: graphs on CUDA
    head.steps = target.runs_on().draft_steps(head)
    verify, prefill = target_costs(target, context, sizes, prompts, repeats)
    h = head_cost(head, target, repeats)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
              f"cpu ({torch.backends.cpu.get_cpu_capability()})", "dtype": str(dtype), "shape": shape,
              "context": context, "verify_ms": {str(k): round(v, 3) for k, v in verify.items()},
              "prefill_ms": {str(k): round(v, 3) for k, v in prefill.items()}, "head_forward_ms": round(h, 3),
              "methods": project(bench, verify, prefill, h, device_host_ms(host)),
              "backend": target.runs_on().summary(),
              "device_seconds": round(time.perf_counter() - started, 1)}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="an infer/run.py output folder (its outputs/*.jsonl)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON report (default: <bench>/gpu_projection.json)")
    ap.add_argument("--host", default=None, help="gpu_check.py --lossless's JSON from the device: its host ms per call")
    args = ap.parse_args()
    report = run(args.bench, args.shape, args.repeats, args.host)
    print(f"{report['device']}, {report['dtype']}, {report['shape']}-shaped random target; verify at "
          f"{report['context']} positions: " + ", ".join(f"c({k}) {v:.1f}" for k, v in report["verify_ms"].items())
          + f" ms; head forward {report['head_forward_ms']:.2f} ms")
    print(f"{'method':<14} {'tokens':>7} {'target s':>9} {'head s':>7} {'host s':>7} {'host ms/call':>12} "
          f"{'TPS':>8} {'×AR':>6} {'CPU ×AR':>8}")
    for m, v in report["methods"].items():
        print(f"{m:<14} {v['tokens']:7d} {v['target_s']:9.2f} {v['head_s']:7.2f} {v['host_s']:7.2f} "
              f"{v['host_ms_per_call']:12.2f} {v['tps']:8.1f} {v.get('x_ar', float('nan')):6.2f} "
              f"{v.get('cpu_x_ar', float('nan')):8.2f}")
    out = Path(args.out or Path(args.bench) / "gpu_projection.json")
    atomic.write_json(out, report)
    print(f"wrote {out} ({report['device_seconds']} s on the device)")


if __name__ == "__main__":
    main()
