"""Stage `continuations`: the target's own greedy responses to the training pool.

An EAGLE-3 head learns to predict *its target's* next tokens, so it trains on what the
target writes, not on the corpus' answers. Every training request (plus fresh multi-call
compositions, so the head sees multi-call responses like the evaluation sets', and
structured-output variants, so it sees answers that are one object under a JSON schema) is
rendered in the target's prompt format and answered greedily on the inference runtime,
under the shared stopping rule, with continuous batching and shared prompt prefixes
(``schemafill.runtime.generation``). A structured output is answered under its schema's
grammar, as it is served; where the grammar chose a token against the target's own greedy
choice the row carries no loss: the head learns the target's choices, the grammar makes its own.

Resumable and scalable by construction: requests are sorted by prompt (so neighbours share
prefixes) and cut into fixed shards (their content depends only on the request list and
the tokenizer); one generation stream runs through all unfinished shards and writes each
shard atomically the moment its last request finishes; finished shards are skipped on a
rerun; under ``accelerate launch --num_processes N`` process i takes shards i, i+N, ... .
The main process merges the shards once into a ``datasets`` dataset with columns
``id, input_ids, loss_mask, prompt_len, response_text``, rows sorted by id.

With ``data.continuations.features`` the generator also keeps the target's features of
every token it computed (``schemafill.runtime.generation``: the forwards that wrote the responses
already hold them); each shard stores them beside its rows and the merge writes them as a
``features/`` feature cache in dataset order, which the head stage reads instead of
running the target over the rows again.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from data_gen.splits import structured_set
from schemafill import atomic
from schemafill.config import PipelineConfig, to_dict
from schemafill.contract.compose import compositions
from schemafill.contract.prompt import model_prompt_ids
from schemafill.contract.records import read_requests
from schemafill.contract.response_format import JSON, ResponseFormat, object_format
from schemafill.contract.stopping import ResponseStop
from schemafill.contract.toolcall import ToolRequest, parse_response
from schemafill.fingerprint import file_digest, fingerprint, load_if_fresh, read_manifest, write_manifest
from schemafill.runtime.device import resolve_device
from schemafill.runtime.feature_cache import FEATURES, FeatureCache, RowFeatures
from schemafill.runtime.generation import generate
from schemafill.runtime.grammar import SchemaGrammars
from schemafill.runtime.loading import decode_choice, generation_eos, load_runtime, load_tokenizer, target_location

OUTPUTS = ["dataset_info.json", "stats.json"]


def continuations_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.paths.artifacts) / "continuations" / cfg.run_name


def pool(cfg: PipelineConfig) -> list[ToolRequest]:
    """Training requests plus multi-call compositions (drawn with a seed of their own)."""
    train_file = Path(cfg.paths.artifacts) / "requests" / "train.jsonl"
    if not train_file.is_file():
        raise FileNotFoundError(f"{train_file} missing: run the `requests` stage first")
    requests, _ = read_requests(train_file)
    gen = cfg.data.continuations
    if gen.max_requests > 0:
        requests = requests[: gen.max_requests]
    referenced = [r for r in requests if r.reference]
    # a different seed from the target's fine-tune: fresh draws, not the SFT compositions again
    composed = compositions(referenced, int(len(requests) * gen.compositions), seed=cfg.seed + 1000,
                            prefix="cont_composed")
    count = min(int(len(requests) * gen.structured), len(referenced))
    structured = structured_set(random.Random(cfg.seed + 2000).sample(referenced, count))
    return requests + composed + structured


def prompts_for(requests: list[ToolRequest], tokenizer: Any, cfg: PipelineConfig) -> tuple[list, dict]:
    """Prompt ids per request (None when it is skipped) and the skip reason by request id."""
    gen = cfg.data.continuations
    prompts: list[list[int] | None] = []
    skipped: dict[str, str] = {}
    for r in requests:
        ids = model_prompt_ids(r, cfg.model, tokenizer)
        if len(ids) + cfg.decode.max_new_tokens > cfg.model.max_context:
            skipped[r.id] = "prompt + response cap exceed model.max_context"
        elif gen.max_prompt_tokens and len(ids) > gen.max_prompt_tokens:
            skipped[r.id] = "prompt longer than data.continuations.max_prompt_tokens"
        else:
            prompts.append(ids)
            continue
        prompts.append(None)
    return prompts, skipped


def shard_plan(prompts: list[list[int] | None], shard_size: int, seed: int) -> list[list[int]]:
    """Shards of request indices: seeded random draws of the pool, so that the first shards,
    all a time budget may leave, are a sample of all of it (compositions included); each in
    prompt order, so neighbours share prefixes (skipped requests last)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [sorted(order[i:i + shard_size], key=lambda j: (prompts[j] is None, prompts[j] or []))
            for i in range(0, len(order), shard_size)]


def run_shards(target: Any, tokenizer: Any, eos: frozenset[int], requests: list[ToolRequest],
               prompts: list, skipped: dict[str, str], shards: dict[int, list[int]], work: Path,
               cfg: PipelineConfig, bar: tqdm) -> bool:
    """Generate every request of ``shards`` in one continuously batched stream; each shard
    is written (atomically) the moment its last request finishes. Past the time budget
    (``data.continuations.max_minutes``) no further shard starts; returns whether it stopped so."""
    rows: dict[int, list[dict]] = {s: [] for s in shards}
    captured: dict[int, dict[str, dict]] = {s: {} for s in shards}  # shard -> id -> features
    capture = cfg.data.continuations.features
    left = {s: sum(prompts[j] is not None for j in idx) for s, idx in shards.items()}
    stream = [(s, j) for s, idx in shards.items() for j in idx if prompts[j] is not None]
    clock = {"last": time.perf_counter(), "tokens": 0, "start": time.perf_counter()}

    def write(s: int) -> None:
        now = time.perf_counter()
        meta = {"skipped": [{"id": requests[j].id, "reason": skipped[requests[j].id]}
                            for j in shards[s] if prompts[j] is None],
                "seconds": now - clock["last"]}  # the stream's time since the previous shard
        clock["last"] = now
        if capture:  # before the rows: a shard's .jsonl is what marks it done
            with atomic.atomic_path(work / f"shard_{s:05d}.features.pt") as tmp:
                torch.save(captured.pop(s), tmp)
        atomic.write_jsonl(work / f"shard_{s:05d}.jsonl", [{"_meta": meta}] + rows[s])

    def done(k: int, g: Any) -> None:
        s, j = stream[k]
        r, ids = requests[j], prompts[j]
        # the target's own choices carry loss; a token the grammar chose against it does not
        learnt = [int(a == t) for a, t in zip(g.greedy, g.ids)] if g.greedy is not None else [1] * len(g.ids)
        rows[s].append({"id": r.id, "input_ids": ids + g.ids, "loss_mask": [0] * len(ids) + learnt,
                        "prompt_len": len(ids), "response_text": g.text, "stop": g.stop,
                        "composed": r.source == "composed", "prefilled": g.prefilled,
                        "output": r.output["name"] if r.object_only else None, "greedy": g.greedy})
        if capture:
            captured[s][r.id] = {"aux": g.aux, "final": g.final}
        left[s] -= 1
        if left[s] == 0:
            write(s)
        clock["tokens"] += len(g.ids)
        bar.update(1)
        bar.set_postfix(tok_s=f"{clock['tokens'] / (time.perf_counter() - clock['start']):.1f}")

    for s in shards:
        if left[s] == 0:
            write(s)
    budget = 60 * cfg.data.continuations.max_minutes
    # where a shard starts (past the first: a launch always makes some progress)
    opens = {k for k in range(1, len(stream)) if stream[k][0] != stream[k - 1][0]}
    stopped = False

    def admit(k: int) -> bool:
        nonlocal stopped
        stopped = bool(budget) and k in opens and time.perf_counter() - clock["start"] > budget
        return not stopped

    # a structured output is answered under its schema's grammar, as it is served
    fmt, cap = cfg.model.fmt, cfg.decode.max_new_tokens
    grammars = None

    def constrain(k: int) -> Any:
        nonlocal grammars
        r = requests[stream[k][1]]
        if not r.object_only:
            return None
        if grammars is None:
            grammars = SchemaGrammars(tokenizer, target.config.vocab_size, fmt, eos)
        return grammars.constraint([r.output_function], True, fmt=r.response_format(fmt),
                                   close_at=cap - cfg.decode.close_margin if cfg.decode.close_margin else None)

    def make_stop(k: int) -> ResponseStop:
        return ResponseStop(tokenizer, eos, cap, fmt=requests[stream[k][1]].response_format(fmt))

    generate(target, tokenizer, [prompts[j] for _, j in stream], cap, cfg.data.continuations.batch_size, eos=eos,
             on_done=done, capture=capture, fmt=fmt, admit=admit, make_stop=make_stop, constrain=constrain)
    return stopped


def build_continuations(cfg: PipelineConfig, tracker: Any = None) -> dict:
    from accelerate import PartialState

    state = PartialState()
    out = continuations_dir(cfg)
    requests = pool(cfg)
    location = target_location(cfg.model, cfg.paths.artifacts)
    target_fp = (read_manifest(location) or {}).get("fingerprint", location)
    m = cfg.model
    device = resolve_device() if state.device.type == "cpu" else state.device
    dtype, precision = decode_choice(m, location, device, verifies=False)
    model_key = {"source": location, "revision": m.revision, "dtype": str(dtype),
                 "prompt_style": m.prompt_style, "chat": m.chat_template_kwargs, "max_context": m.max_context}
    if cfg.data.continuations.features:
        model_key["aux_layer_ids"] = list(m.aux_layer_ids)
    gen = to_dict(cfg.data.continuations)
    inputs = {"model": model_key, "target": target_fp, "gen": {k: v for k, v in gen.items() if k != "max_minutes"},
              "max_new_tokens": cfg.decode.max_new_tokens, "seed": cfg.seed,
              "train": file_digest(Path(cfg.paths.artifacts) / "requests" / "train.jsonl"), "format": 5}
    shards_fp = fingerprint(inputs)  # what a shard's rows depend on: not the budget, so a larger one resumes
    fp = fingerprint({**inputs, "max_minutes": gen["max_minutes"]})
    outputs = OUTPUTS + ([f"{FEATURES}/meta.json"] if cfg.data.continuations.features else [])
    if (stats := load_if_fresh("continuations", out, fp, outputs, "stats.json", lambda s: f"{s['rows']} rows",
                               quiet=not state.is_main_process)) is not None:
        return {**stats, "cached": True}
    if state.is_main_process:
        print(f"[continuations] precision: {str(dtype).removeprefix('torch.')} ({precision['why']})")

    work = out.parent / f".{out.name}.shards" / shards_fp  # keyed by fingerprint: a changed input never mixes in
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(location, m.revision)
    prompts, skipped = prompts_for(requests, tokenizer, cfg)
    plan = shard_plan(prompts, cfg.data.continuations.shard_size, cfg.seed)
    mine = [i for i in range(len(plan)) if i % state.num_processes == state.process_index]
    todo = [i for i in mine if not (work / f"shard_{i:05d}.jsonl").exists()]
    reused = sum((work / f"shard_{i:05d}.jsonl").exists() for i in range(len(plan)))
    if state.is_main_process:
        print(f"[continuations] {len(requests)} requests ({len(skipped)} skipped) in {len(plan)} shards "
              f"({reused} done before), {state.num_processes} process(es)")
    state.wait_for_everyone()  # everyone counted finished shards before anyone writes new ones
    t0 = time.perf_counter()
    if todo:
        aux = m.aux_layer_ids if cfg.data.continuations.features else None  # else the defaults: unused
        target = load_runtime(location, dtype, device, aux, revision=m.revision, backend=m.backend, decodes=False)
        eos = generation_eos(location, tokenizer, m.revision)
        bar = tqdm(total=sum(prompts[j] is not None for i in todo for j in plan[i]),
                   desc=f"continuations[{state.process_index}]", unit="req", dynamic_ncols=True,
                   position=state.process_index)
        if run_shards(target, tokenizer, eos, requests, prompts, skipped, {i: plan[i] for i in todo}, work, cfg, bar):
            bar.write(f"[continuations] time budget of {cfg.data.continuations.max_minutes} min reached: "
                      f"no further shard starts (data.continuations.max_minutes)")
        bar.close()
    state.wait_for_everyone()
    if state.is_main_process:
        source = {"aux_layer_ids": list(m.aux_layer_ids), "dtype": str(dtype), "stage": "continuations"}
        written = [i for i in range(len(plan)) if (work / f"shard_{i:05d}.jsonl").exists()]
        partial = len(written) < len(plan)
        stats = merge(work, written, len(requests), out, time.perf_counter() - t0, fp, reused,
                      features=source if cfg.data.continuations.features else None, fmt=cfg.model.fmt,
                      extra={"shards_planned": len(plan), "stopped_by": "max_minutes" if partial else None})
        if partial:
            print(f"[continuations] kept {len(written)} of {len(plan)} shards; a larger "
                  f"data.continuations.max_minutes resumes from them")
        else:
            shutil.rmtree(work.parent, ignore_errors=True)  # merged: the shards have served their purpose
    state.wait_for_everyone()  # no rank moves on (e.g. to the head stage) before the merge is on disk
    if not state.is_main_process:
        return {"process": state.process_index, "shards": len(todo)}
    print(f"[continuations] wrote {out}: {json.dumps({k: stats[k] for k in ('rows', 'valid_json_rate', 'tokens_per_s', 'empty_rate', 'composed_share')})}")
    if tracker is not None:
        tracker.summary({f"continuations/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
    return {**stats, "precision": precision, "cached": False}


def merge(work: Path, shards: list[int], requests: int, out: Path, wall: float, fp: str, reused: int,
          features: dict | None = None, fmt: ResponseFormat = JSON, extra: dict | None = None) -> dict:
    """The written ``shards`` → one dataset (atomically) and its statistics (responses read as
    ``fmt``); with ``features`` (their provenance) also the shards' captured features as one
    feature cache in row order."""
    import datasets

    rows, skipped, gen_seconds = [], [], 0.0
    for i in shards:
        lines = (work / f"shard_{i:05d}.jsonl").read_text().splitlines()
        meta = json.loads(lines[0])["_meta"]
        skipped += meta["skipped"]
        gen_seconds += meta["seconds"]
        rows += [json.loads(line) for line in lines[1:]]
    rows.sort(key=lambda r: r["id"])  # one order whatever the process count or shard timing
    n = max(len(rows), 1)
    response_tokens = sum(len(r["input_ids"]) - r["prompt_len"] for r in rows)
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    stats = {
        "rows": len(rows),
        "requests": requests,
        "mean_prompt_tokens": sum(r["prompt_len"] for r in rows) / n,
        "mean_response_tokens": response_tokens / n,
        "valid_json_rate": sum(parse_response(r["response_text"].strip(), row_format(r, fmt)) is not None
                               for r in rows) / n,
        "empty_rate": sum(not r["response_text"].strip() for r in rows) / n,
        "composed_share": sum(r["composed"] for r in rows) / n,
        "structured_share": sum(bool(r.get("output")) for r in rows) / n,
        # response tokens where a grammar chose against the target: no loss there
        "grammar_chosen_tokens": sum(len(r["input_ids"]) - r["prompt_len"] - sum(r["loss_mask"]) for r in rows),
        "stops": {s: sum(r["stop"] == s for r in rows) for s in ("closed", "eos", "length")},
        "skipped": len(skipped),
        "skipped_by_reason": reasons,
        "generation_seconds": round(gen_seconds, 1),  # summed over processes
        "tokens_per_s": round(response_tokens / max(gen_seconds, 1e-9), 1),
        "seconds": round(wall, 1),
        "prompt_tokens_prefilled_share": round(sum(r["prefilled"] for r in rows) / max(sum(r["prompt_len"] for r in rows), 1), 3),
        "shards": len(shards),
        "shards_reused": reused,
        **(extra or {}),
    }
    columns = ("id", "input_ids", "loss_mask", "prompt_len", "response_text")
    ds = datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in columns})
    with atomic.atomic_path(out) as tmp:
        ds.save_to_disk(str(tmp))
        if features is not None:
            write_features(work, shards, rows, tmp / FEATURES, features)
        atomic.write_json(tmp / "stats.json", stats)
        write_manifest(tmp, fp, stage="continuations")
    return stats


def row_format(row: dict, fmt: ResponseFormat) -> ResponseFormat:
    """How a row's response is written: a structured output's object, else the target's calls."""
    return object_format(row["output"]) if row.get("output") else fmt


def write_features(work: Path, shards: list[int], rows: list[dict], folder: Path, source: dict) -> FeatureCache:
    """The shards' captured features as one cache in the order of ``rows`` (the dataset's),
    read one shard at a time: the whole pool's features need not fit in memory."""
    index = {r["id"]: i for i, r in enumerate(rows)}
    files = [work / f"shard_{i:05d}.features.pt" for i in shards]
    first = next((c for f in files for c in torch.load(f, mmap=True).values()), None)  # shapes only
    aux_dim, hidden = (first["aux"].shape[-1], first["final"].shape[-1]) if first else (0, 0)

    def captured():
        for f in files:
            for rid, c in torch.load(f).items():
                i = index[rid]
                start = rows[i]["prompt_len"] - 1
                # the target's greedy choice at each response position: the token it wrote next,
                # unless a grammar chose that one
                greedy = rows[i].get("greedy") or rows[i]["input_ids"][start + 1:]
                yield i, RowFeatures(aux=c["aux"], final=c["final"], start=start, argmax=torch.tensor(greedy))

    return FeatureCache.write(folder, [len(r["input_ids"]) for r in rows], aux_dim, hidden, captured(), source)
