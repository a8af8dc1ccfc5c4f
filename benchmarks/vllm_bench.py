"""vLLM bench: SchemaFill's proposer inside vLLM beside vLLM's own speculation, on one target.

    make vllm-bench                       # its own environment (.venv-vllm), so `make test` stays light
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_bench.py [--limit 16] [--at-once 4,16,64]
                                                   [--configs ar,ngram,suffix,schemafill]
                                                   [--artifacts artifacts] [--out outputs/bench/vllm.json]

Each configuration runs in a process of its own (one vLLM engine at a time on the host): the
same BFCL450 requests (spread over the file, rendered as the pipeline renders them for the
target), greedy, up to ``--max-tokens`` tokens each, first ``--limit`` of them one request at a
time, then the first n of them submitted at once for each n in ``--at-once`` (default 4, 16 and
64: a server's load), each pass from a cold prefix cache (vLLM keeps prompt prefixes: a pass after
one that read the same prompts would skip their prefill). Reports tokens per second,
acceptance length (vLLM's own counters: 1 + accepted / drafts), and whether every output equals
vLLM's greedy output without speculation; JSON, and a table to paste into docs/.

Configurations: ``ar`` (no speculation), ``ngram`` (vLLM's prompt lookup, k=4),
``suffix`` (vLLM's suffix decoding; needs the arctic-inference package, reported as an error
when it is missing), ``schemafill`` (``infer.vllm.proposer.SchemaFillProposer``, k=``--k``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from schemafill import atomic
from schemafill.runtime import host

CONFIGS = "ar,ngram,suffix,schemafill"
ROOT = Path(__file__).resolve().parent.parent


def speculative_config(name: str, k: int) -> dict | None:
    if name == "ar":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if name == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if name == "schemafill":
        return {"method": "custom_class", "model": "infer.vllm.proposer.SchemaFillProposer", "num_speculative_tokens": k}
    raise ValueError(f"unknown configuration {name!r}; expected one of {CONFIGS}")


def prompts(artifacts: Path, limit: int, model_name: str) -> tuple[list[str], list[list[int]], str, Any]:
    """The requests' ids, prompt token ids and the target folder, as the pipeline renders them
    (the model's settings from ``conf/model/<name>.yaml``)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from schemafill.config import ModelConfig
    from schemafill.contract.prompt import model_prompt_ids
    from schemafill.contract.records import read_requests, spread

    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                                OmegaConf.load(ROOT / "conf" / "model" / f"{model_name}.yaml")))
    target = artifacts / "targets" / model.name
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"no fine-tuned target at {target}: run `make run` first (or pass --artifacts)")
    requests = spread(read_requests(str(artifacts / "requests" / "bfcl450.jsonl"))[0], limit)
    tokenizer = AutoTokenizer.from_pretrained(target)
    return [r.id for r in requests], [model_prompt_ids(r, model, tokenizer) for r in requests], str(target), model


def counters(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                      "vllm:spec_decode_num_draft_tokens"):
            out[m.name.split(":")[1]] = float(getattr(m, "value", 0) or 0)
    return out


def response_lengths(outputs: list[list[int]], tokenizer, fmt, eos: frozenset[int], cap: int) -> list[int]:
    """Where each response ends by the pipeline's stopping rule (a self-closing format's close,
    EOS, the cap): vLLM knows only EOS, and past a closed JSON object a target writes on."""
    from schemafill.contract.stopping import ResponseStop

    lengths = []
    for ids in outputs:
        stop = ResponseStop(tokenizer, eos, cap, fmt=fmt)
        stop.push(list(ids))
        lengths.append(max(1, len(stop.ids)))
    return lengths


def run_config(name: str, args: argparse.Namespace, lengths: list[int] | None) -> dict:
    """One configuration in this process: one request at a time, then each load at once, each
    request decoding exactly ``lengths[i]`` tokens (without them: measured first, greedy)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from schemafill.contract.stopping import eos_token_ids

    loads = at_once(args)
    ids, prompt_ids, target, model = prompts(Path(args.artifacts), max(args.limit, *loads), args.model)
    started = time.perf_counter()
    llm = LLM(model=target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, disable_log_stats=False,
              speculative_config=speculative_config(name, args.k))
    startup = time.perf_counter() - started
    if lengths is None:
        tokenizer = AutoTokenizer.from_pretrained(target)
        free = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
        lengths = response_lengths([o.outputs[0].token_ids for o in free], tokenizer, model.fmt,
                                   eos_token_ids(tokenizer), args.max_tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]

    def al(a: dict, b: dict) -> float | None:
        drafts = b.get("spec_decode_num_drafts", 0) - a.get("spec_decode_num_drafts", 0)
        accepted = b.get("spec_decode_num_accepted_tokens", 0) - a.get("spec_decode_num_accepted_tokens", 0)
        return round(1 + accepted / drafts, 3) if drafts else None

    def timed(batches: list[list[int]]) -> tuple[list[list[int]], dict]:
        """Each batch of request indices submitted at once, one after another, from a cold
        prefix cache: no configuration finds the prompts that an earlier pass (AR's untimed
        one, which measures the lengths, or the previous load) prefilled."""
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: the loads would not start alike")
        before, outputs, t0 = counters(llm), [], time.perf_counter()
        for batch in batches:
            outputs += llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in batch], [params[i] for i in batch],
                                    use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return tokens, {"requests": len(tokens), "tokens": sum(map(len, tokens)), "seconds": round(seconds, 3),
                        "tps": round(sum(map(len, tokens)) / seconds, 2), "al": al(before, counters(llm))}

    tokens_one, one = timed([[i] for i in range(min(args.limit, len(prompt_ids)))])
    loaded = {n: timed([list(range(min(n, len(prompt_ids))))]) for n in loads}
    return {"config": name, "speculative_config": speculative_config(name, args.k), "startup_s": round(startup, 1),
            "ids": ids, "lengths": lengths, "outputs": tokens_one, "one": one,
            "at_once": {str(n): {**r, "outputs": t} for n, (t, r) in loaded.items()}}


def at_once(args: argparse.Namespace) -> list[int]:
    """The loads ``--at-once`` names, requests submitted together."""
    loads = [int(n) for n in str(args.at_once).split(",") if n]
    if not loads or min(loads) < 1:
        raise ValueError(f"--at-once must name loads of at least one request, got {args.at_once!r}")
    return loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS, help=f"comma-separated, from {CONFIGS}")
    ap.add_argument("--limit", type=int, default=16, help="requests decoded one at a time, spread over BFCL450")
    ap.add_argument("--at-once", default="4,16,64", help="loads: this many requests submitted at once, each in turn")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per step for suffix and schemafill")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--model", default="smollm2-135m", help="conf/model/<name>.yaml: the target and its prompts")
    ap.add_argument("--out", default="outputs/bench/vllm.json")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run this configuration here
    ap.add_argument("--lengths", default=None, help=argparse.SUPPRESS)  # internal: each request's tokens
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: where the child writes
    args = ap.parse_args()
    if args.one:
        lengths = json.loads(Path(args.lengths).read_text()) if args.lengths else None
        Path(args.result).write_text(json.dumps(run_config(args.one, args, lengths)))
        return

    names = args.configs.split(",")
    for name in names:
        speculative_config(name, args.k)  # a wrong name fails before any engine starts
    loads = at_once(args)
    names = ["ar"] + [n for n in names if n != "ar"]  # AR first: its outputs fix every request's length
    results, errors, lengths = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"[vllm-bench] {name} ...", flush=True)
            result = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name, "--result", str(result)]
            if lengths is not None:
                (Path(tmp) / "lengths.json").write_text(json.dumps(lengths))
                cmd += ["--lengths", str(Path(tmp) / "lengths.json")]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE":
                                       os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")})
            if done.returncode == 0 and result.is_file():
                results[name] = json.loads(result.read_text())
                lengths = lengths or results[name]["lengths"]
                r = results[name]
                print(f"[vllm-bench] {name}: {r['one']['tps']} tok/s one at a time, " +
                      ", ".join(f"{r['at_once'][str(n)]['tps']} at {n}" for n in loads), flush=True)
            else:
                tail = [ln for ln in (done.stderr or done.stdout).strip().splitlines()
                        if "Error" in ln or "error" in ln][-4:] or (done.stderr or done.stdout).strip().splitlines()[-4:]
                errors[name] = "\n".join(tail)
                print(f"[vllm-bench] {name} failed (exit {done.returncode}):\n  " + "\n  ".join(tail), flush=True)
                if name == "ar":
                    break
    reference = results.get("ar")
    rows = []
    for name, r in results.items():
        ar = reference or r
        r["equal_to_ar"] = None if reference is None else \
            sum(a == b for a, b in zip(r["outputs"], reference["outputs"]))
        cells = [f"{r['one']['tps']:.1f} ({r['one']['tps'] / ar['one']['tps']:.2f}×, AL {r['one']['al'] or '-'})"]
        equal = [f"{r['equal_to_ar']}/{len(r['outputs'])}" if reference else "-"]
        for n in loads:
            mine, theirs = r["at_once"][str(n)], ar["at_once"][str(n)]
            mine["equal_to_ar"] = None if reference is None else \
                sum(a == b for a, b in zip(mine["outputs"], theirs["outputs"]))
            cells.append(f"{mine['tps']:.1f} ({mine['tps'] / theirs['tps']:.2f}×, AL {mine['al'] or '-'})")
            equal.append(f"{mine['equal_to_ar']}/{len(mine['outputs'])}" if reference else "-")
        rows.append((name, cells, ", ".join(equal), r["startup_s"]))
    out = {"host": host.summary(), "configs": results, "errors": errors,
           "args": {k: v for k, v in vars(args).items() if k not in ("one", "lengths", "result")}}
    path = Path(args.out)
    atomic.write_json(path, out)
    print(f"\n| vLLM ({args.dtype}) | one at a time tok/s (×AR, AL) | " +
          " | ".join(f"{n} at once" for n in loads) + " | = AR's tokens (one, " + ", ".join(map(str, loads)) +
          ") | start-up s |")
    print("|---" * (len(loads) + 4) + "|")
    for name, cells, same, startup in rows:
        print(f"| {name} | " + " | ".join(cells) + f" | {same} | {startup} |")
    h = out["host"]
    print(f"[vllm-bench] host: {h['cpu_model']} ({h['cpu_capability']}, {h['cpu_count']} CPUs); wrote {path}")


if __name__ == "__main__":
    main()
