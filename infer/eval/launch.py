"""One launch: a requests file decoded with several methods on one runtime, side by side
(``infer/run.py`` is its command line; the eval stage and the benchmarks call ``run``).

Writes ``<out>/metrics.json`` — per method: accept_length (Σtokens/Σtarget_calls), tps
(Σtokens/Σseconds), ar_agreement (share of requests whose tokens equal AR's), tokens,
target_calls, seconds, requests, nodes_per_verify; by_category where the requests name
several categories — and ``<out>/outputs/<method>.jsonl``
with one line per request. Timing covers prompt rendering through stop; model loading and
``warmup`` requests are not timed. Malformed records and requests that do not fit the
context are named in ``<out>/skipped.jsonl`` and the rest are decoded.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from infer import decoders
from infer.decoders.context import DecoderContext
from infer.eval.metrics import by_category, pooled
from infer.rounds import loop
from infer.rounds.decoding import DecodeOptions
from infer.rounds.options import request_options
from schemafill import atomic
from schemafill.config import InferConfig, to_dict
from schemafill.contract.prompt import model_prompt_ids
from schemafill.contract.records import evenly, read_requests
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.device import resolve_device
from schemafill.runtime.grammar import SchemaGrammars, valid_response
from schemafill.runtime.loading import load_launch_target
from schemafill.tracking import start_run


def request_seed(seed: int, request_id: str, sample: int) -> int:
    """Each (request, sample) draws from its own stream, whatever else runs."""
    return int(hashlib.sha256(f"{seed}:{request_id}:{sample}".encode()).hexdigest()[:8], 16)


DIAGNOSTICS = ("nodes", "init_nodes", "times", "kv_rows", "pruned")  # pooled into metrics.json, not per output


def _decode(decoder, r: ToolRequest, k: int, repeat: int, options, cfg: InferConfig, tokenizer) -> dict:
    """One timed decode: prompt rendering through stop."""
    opts = options(r, request_seed(cfg.decode.seed, r.id, k))
    t0 = time.perf_counter()
    ids = model_prompt_ids(r, cfg.model, tokenizer)
    d = decoder.decode(r, ids, opts)
    return _row(r, k, repeat, ids, d, time.perf_counter() - t0, cfg)


def _row(r: ToolRequest, k: int, repeat: int, ids: list[int], d, seconds: float, cfg: InferConfig) -> dict:
    return {"id": r.id, "sample": k, "repeat": repeat, "text": d.text, "prompt_ids": ids, "output_ids": d.ids,
            "target_calls": d.target_calls, "seconds": round(seconds, 4), "stop": d.stop, "nodes": d.nodes,
            "init_nodes": d.init_nodes, "times": d.times, "kv_rows": d.kv_rows, "forced": d.forced,
            "pruned": d.pruned,
            "valid": valid_response(d.text, r.slot_functions, fmt=r.response_format(cfg.model.fmt)),
            "call_rows": d.call_rows, "call_ms": d.call_ms, "head_forwards": d.head_forwards, "head_ms": d.head_ms}


def _decode_together(target, decoder, items: list, options, cfg: InferConfig, tokenizer) -> tuple[list[dict], float]:
    """``items`` (repeat, request, sample) decoded ``cfg.concurrency`` at a time in one batch:
    their rows (``seconds``: each request's latency, joining to end) and the wall seconds."""
    started, prompts = {}, {}

    def joining(i: int, r: ToolRequest, k: int):
        def make():
            started[i] = time.perf_counter()
            prompts[i] = model_prompt_ids(r, cfg.model, tokenizer)
            return decoder.stream(r, prompts[i], options(r, request_seed(cfg.decode.seed, r.id, k)))
        return make

    t0, rows = time.perf_counter(), {}
    for i, stream in loop.decode_all(target, [joining(i, r, k) for i, (_, r, k) in enumerate(items)],
                                     cfg.concurrency):
        if stream.error is not None:
            raise stream.error
        p, r, k = items[i]
        rows[i] = _row(r, k, p, prompts[i], stream.decoded(), time.perf_counter() - started[i], cfg)
    return [rows[i] for i in range(len(items))], time.perf_counter() - t0


def _decode_interleaved(methods: dict, items: list, outputs: dict, kept: list, options, cfg: InferConfig, tokenizer,
                        ctx: DecoderContext) -> None:
    """One request at a time, each decoded by every method before the next (their order
    rotating), so a host that slows down or speeds up mid-launch shifts every method alike."""
    blocks = [[(p, r, k, m) for m in methods] for p, r, k in items] if cfg.interleave else \
        [[(p, r, k, m)] for m in methods for p, r, k in items]
    bar = tqdm(total=len(items) * len(methods), desc="decode", unit="req", dynamic_ncols=True)
    for b, block in enumerate(blocks):
        shift = b % len(block)
        order = block[shift:] + block[:shift]
        # Parallel Fill fills AR's response of the same request: it goes after AR
        order = [x for x in order if x[3] not in decoders.SKELETON_METHODS] + \
            [x for x in order if x[3] in decoders.SKELETON_METHODS]
        for p, r, k, method in order:
            decoder = methods[method]
            if r is kept[0] and k == 0:  # what a method learns across requests, it learns from this pass only
                decoders.reset(decoder)
            row = _decode(decoder, r, k, p, options, cfg, tokenizer)
            outputs[method].append(row)
            if method == "ar":  # the skeletons Parallel Fill fills
                ctx.skeletons[r.id] = row
            bar.update()
    bar.close()


def run(cfg: InferConfig) -> dict:
    decoders.check(cfg.methods, cfg.decode.temperature)
    if cfg.concurrency > 1 and any(m in decoders.SKELETON_METHODS for m in cfg.methods):
        raise ValueError(f"{decoders.SKELETON_METHODS} fill AR's skeletons one request at a time: drop them or set "
                         f"concurrency=1")
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    target, tokenizer, eos = load_launch_target(cfg.model, cfg.paths.artifacts, device)

    # ---- requests: malformed records and over-long prompts are named and skipped
    requests, rejected = read_requests(cfg.requests)
    skipped = [{"id": r.id, "line": r.line, "reason": r.reason} for r in rejected.items]
    if 0 < cfg.limit < len(requests):
        if cfg.sample == "first":
            requests = requests[: cfg.limit]
        else:  # evenly spaced: evaluation files are grouped by category
            requests = evenly(requests, cfg.limit)
    kept: list[ToolRequest] = []
    for r in requests:
        n = len(model_prompt_ids(r, cfg.model, tokenizer))
        if n + cfg.decode.max_new_tokens > cfg.model.max_context:
            skipped.append({"id": r.id, "line": None, "reason": f"prompt of {n} tokens + max_new_tokens "
                                                              f"{cfg.decode.max_new_tokens} exceed the context "
                                                              f"({cfg.model.max_context})"})
        else:
            kept.append(r)
    if skipped:
        print(f"[infer] skipped {len(skipped)} request(s), e.g. {skipped[0]}")
    if not kept:
        raise ValueError(f"no decodable request in {cfg.requests} ({len(skipped)} skipped)")

    # ---- decode the same requests with every method
    ctx = DecoderContext(target, tokenizer, eos, cfg.decode,
                         cfg.head or str(Path(cfg.paths.artifacts) / "heads" / cfg.model.name),
                         fmt=cfg.model.fmt)
    methods = decoders.build(cfg.methods, ctx)
    # compiled once per catalog, before any timing; Parallel Fill is not constrained
    grammars = (SchemaGrammars(tokenizer, target.config.vocab_size, cfg.model.fmt, eos)
                if cfg.decode.constrain != "none" or any(r.output for r in kept) else None)
    out = Path(cfg.out)

    def options(r: ToolRequest, seed: int) -> DecodeOptions:
        return request_options(cfg.decode, lambda: grammars, r.functions, seed=seed, request=r)

    for method, decoder in methods.items():  # untimed; AR's warm-up outputs are Parallel Fill's skeletons
        for r in kept[: cfg.warmup]:
            row = _decode(decoder, r, 0, -1, options, cfg, tokenizer)
            if method == "ar":
                ctx.skeletons[r.id] = row
    outputs: dict[str, list[dict]] = {m: [] for m in methods}
    items = [(p, r, k) for p in range(cfg.repeats) for r in kept for k in range(cfg.samples)]
    walls: dict[str, float] = {}
    if cfg.concurrency > 1:  # method by method, each a batch of cfg.concurrency requests at a time
        for method, decoder in tqdm(methods.items(), desc=f"decode x{cfg.concurrency}", unit="method"):
            decoders.reset(decoder)
            outputs[method], walls[method] = _decode_together(target, decoder, items, options, cfg, tokenizer)
    else:
        _decode_interleaved(methods, items, outputs, kept, options, cfg, tokenizer, ctx)

    # ---- metrics, pooled over requests
    # AR agreement is the lossless check at temperature 0; samples agree only in distribution
    greedy = cfg.decode.temperature == 0
    reference = {r["id"]: r["output_ids"] for r in outputs["ar"]} if "ar" in outputs and greedy else None
    metrics = {m: pooled(rows, reference, walls.get(m)) for m, rows in outputs.items()}
    category = {r.id: r.category or "-" for r in kept}
    categories = by_category(outputs, category, reference, alone=cfg.concurrency == 1) \
        if len(set(category.values())) > 1 else {}
    for m, split in categories.items():
        metrics[m]["by_category"] = split
    for m, decoder in methods.items():
        budget = getattr(decoder, "budget", None)
        if budget is not None and getattr(budget, "stats", None) is not None:
            metrics[m]["selection"] = budget.report()
    for m, rows in outputs.items():
        atomic.write_jsonl(out / "outputs" / f"{m}.jsonl",
                           [{k: v for k, v in r.items() if k not in DIAGNOSTICS} for r in rows])
    atomic.write_jsonl(out / "skipped.jsonl", skipped)
    atomic.write_json(out / "metrics.json", metrics)
    ar_tps = metrics.get("ar", {}).get("tps")
    print(f"{'method':<13} {'AL':>6} {'TPS':>8} {'×AR':>6} {'agree':>6} {'nodes':>6} {'valid':>6} {'forced':>6}")
    for m, v in metrics.items():
        ratio = f"{v['tps'] / ar_tps:6.2f}" if ar_tps else "     -"
        agree = f"{v['ar_agreement']:6.3f}" if v["ar_agreement"] is not None else "     -"
        al = f"{v['accept_length']:6.2f}" if v["accept_length"] is not None else "     -"
        print(f"{m:<13} {al} {v['tps']:8.1f} {ratio} {agree} {v['nodes_per_verify']:6.1f} {v['valid_rate']:6.2f} "
              f"{v['forced']:6d}")
    if categories and cfg.concurrency == 1 and "ar" in categories:  # where each method gains, and where not
        print(f"{'×AR by category':<28}" + "".join(f" {m:>8}" for m in categories))
        for c in categories["ar"]:
            print(f"{c[:27]:<28}" + "".join(f" {categories[m][c]['x_ar']:>{max(8, len(m))}.2f}" for m in categories))
    print(f"[infer] wrote {out / 'metrics.json'}")
    if grammars is not None:
        ms = sorted(1e3 * t for t in grammars.compile_seconds)
        print(f"[infer] response grammars: {len(ms)} catalogs compiled, median {ms[len(ms) // 2]:.1f} ms, "
              f"max {ms[-1]:.1f} ms (cached per catalog, outside the timed decode)")
    backend = target.runs_on().summary()
    atomic.write_json(out / "backend.json", backend)
    print(f"[infer] backend: {backend}")
    tracker = start_run(cfg.logger, to_dict(cfg), name=cfg.model.name, job_type="infer")
    try:
        tracker.summary({f"{m}/{k}": v for m, vals in metrics.items() for k, v in vals.items() if v is not None}
                        | {"backend": backend["backend"]})
    finally:
        tracker.finish()
    return {"metrics": metrics, "skipped": skipped, "out": str(out), "rows": outputs, "backend": backend}
