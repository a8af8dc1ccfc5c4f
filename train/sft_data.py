"""The target fine-tune's examples and batches (stage `target`): referenced requests plus
multi-call compositions, resampled to a call mix, tokenized as prompt + canonical response,
and grouped by length into batches of a padded-token budget. ``train.sft`` trains on them.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from schemafill.config import ModelConfig, TargetTrainConfig
from schemafill.contract.compose import compositions
from schemafill.contract.prompt import model_prompt_ids, response_ids
from schemafill.contract.toolcall import ToolRequest, serialize_calls


@dataclass(frozen=True)
class Example:
    id: str
    input_ids: list[int]  # prompt + response
    prompt_len: int
    calls: int
    composed: bool = False  # a multi-call composition of several requests (schemafill.contract.compose)
    decisions: tuple[int, ...] = ()  # positions of response tokens holding a closing decision


def build_examples(requests: list[ToolRequest], tokenizer: Any, model: ModelConfig, train: TargetTrainConfig,
                   seed: int) -> tuple[list[Example], dict]:
    """Tokenized SFT examples: referenced requests plus multi-call compositions of them, as
    many of each call count as ``train.call_mix`` and ``train.max_examples`` ask.

    Only the candidates a selection needs are rendered and tokenized: with ``max_examples`` a
    bucket is read in its drawing order until it holds its share, not the whole pool (a
    thousand-request pool's prompts take longer to tokenize than a short fine-tune's steps)."""
    rng = random.Random(seed)
    referenced = [r for r in requests if r.reference]
    if train.max_catalog > 0:
        referenced = [trim_catalog(r, train.max_catalog, rng) for r in referenced]
    # BFCL450 averages 3.1 calls: weight 3- and 4-call compositions, and compose parts with
    # small catalogs so the composed prompts fit max_seq_len instead of being skipped
    composed = compositions(referenced, int(len(referenced) * train.compositions), seed=seed, prefix="sft_composed",
                            same_tool_share=0.6, sizes=(2, 3, 4, 4, 4), max_catalog=train.compose_max_catalog)
    if train.max_catalog > 0:  # a composition joins its parts' catalogs: trim the union too
        composed = [trim_catalog(r, train.max_catalog, rng) for r in composed]
    # Most corpus requests need one call; BFCL450 needs 2-4 (3.1 on average). Left as is, the
    # model learns one call as its prior and writes far fewer calls than asked, so
    # examples are drawn to `call_mix` shares of 1, 2, 3 and 4+ calls.
    buckets: list[list[ToolRequest]] = [[] for _ in train.call_mix]
    for req in referenced + composed:
        buckets[min(len(req.reference), len(buckets)) - 1].append(req)
    cap = train.max_examples / sum(train.call_mix) if train.max_examples > 0 else math.inf
    fitted: list[list[Example]] = []
    read = too_long = 0
    total = cap  # examples per unit of call_mix share; an exhausted bucket may lower it
    for bucket, share in zip(buckets, train.call_mix):
        fit: list[Example] = []
        fitted.append(fit)
        if share <= 0:
            continue
        # ceil: a bucket left partly unread holds at least its share of the cap
        want = math.ceil(cap * share) if math.isfinite(cap) else len(bucket)
        for req in natural_first(bucket, rng):
            if len(fit) >= want:
                break
            read += 1
            example = tokenized(req, tokenizer, model, train)
            if example is None:
                too_long += 1  # never truncated: a cut response would teach a broken format
            else:
                fit.append(example)
        else:  # every candidate read: the bucket holds all it can
            total = min(total, len(fit) / share)
    empty = [i + 1 for i, (fit, share) in enumerate(zip(fitted, train.call_mix)) if share > 0 and not fit]
    if empty:
        raise ValueError(f"no fine-tuning examples with {empty} call(s) fit max_seq_len={train.max_seq_len}; "
                         "raise train.target.max_seq_len or set their train.target.call_mix share to 0")
    examples = [e for fit, share in zip(fitted, train.call_mix) for e in fit[:int(total * share)]]
    stats = {"referenced": len(referenced), "composed": len(composed), "read": read, "examples": len(examples),
             "examples_by_calls": {f"{i + 1}{'+' if i + 1 == len(buckets) else ''}": int(total * share)
                                   for i, share in enumerate(train.call_mix)},
             "mean_calls": sum(e.calls for e in examples) / max(len(examples), 1),
             "natural_multi_call": sum(e.calls > 1 and not e.composed for e in examples),
             "skipped_too_long": too_long, "max_seq_len": train.max_seq_len}
    return examples, stats


def tokenized(req: ToolRequest, tokenizer: Any, model: ModelConfig, train: TargetTrainConfig) -> Example | None:
    """``req`` as an example (prompt + canonical response + EOS where the format needs it), or
    None when it does not fit ``train.max_seq_len``."""
    fmt = model.fmt
    # a format whose text does not end the response is ended by EOS: the target must learn to write it
    end = [] if fmt.self_closing else [tokenizer.eos_token_id]
    ids = model_prompt_ids(req, model, tokenizer)
    text = serialize_calls(req.reference, fmt)
    resp = response_ids(text, tokenizer)
    if len(ids) + len(resp) + len(end) > train.max_seq_len:
        return None
    decisions = decision_tokens(text, resp, tokenizer) if train.decision_weight != 1.0 else ()
    return Example(req.id, ids + resp + end, len(ids), len(req.reference), req.source == "composed",
                   tuple(len(ids) + i for i in decisions))


def closing_offsets(text: str) -> list[int]:
    """Offsets of the structural ``,``, ``}`` and ``]`` of JSON ``text`` (outside strings).

    Each is where the writer decides between another member (key, element or call) and
    closing the container: the decisions that, when wrong, repeat keys or calls or never
    close (``train.target.decision_weight`` weights their tokens)."""
    offsets, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in ",}]":
            offsets.append(i)
    return offsets


def decision_tokens(text: str, ids: list[int], tokenizer: Any) -> list[int]:
    """Indexes into ``ids`` (``text`` tokenized) of the tokens holding one of its closing
    decisions (``closing_offsets``): another key or call, or close."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("train.target.decision_weight needs a fast tokenizer (character offsets); "
                         "set it to 1.0 for this target")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc.input_ids != ids:
        raise ValueError("the response's offsets were computed on other tokens than its ids")
    closing = closing_offsets(text)
    return [i for i, (a, b) in enumerate(enc.offset_mapping) if any(a <= c < b for c in closing)]


def trim_catalog(request: ToolRequest, size: int, rng: random.Random) -> ToolRequest:
    """``request`` with its catalog cut to the called tools plus random others, ``size`` in
    all (never fewer than the called ones), in the catalog's own order."""
    called = {c.name for c in request.reference or []}
    others = [t["function"]["name"] for t in request.tools if t["function"]["name"] not in called]
    keep = called | set(rng.sample(others, max(0, min(size - len(called), len(others)))))
    if len(keep) >= len(request.tools):
        return request
    return dataclasses.replace(request, tools=[t for t in request.tools if t["function"]["name"] in keep])


def natural_first(bucket: list[ToolRequest], rng: random.Random) -> list[ToolRequest]:
    """A call-count bucket in its drawing order: the corpus' own requests before compositions,
    each shuffled.

    A natural multi-call request asks for several things in one sentence, as BFCL's parallel
    sets do; a composition joins separate requests line by line. Both teach several calls,
    but only the natural ones teach reading them out of one sentence, and they are few.
    """
    natural = [r for r in bucket if r.source != "composed"]
    joined = [r for r in bucket if r.source == "composed"]
    rng.shuffle(natural)
    rng.shuffle(joined)
    return natural + joined


def batches(examples: list[Example], batch_tokens: int, seed: int):
    """Endless stream of length-grouped batches of at most ``batch_tokens`` padded tokens."""
    if not examples:
        raise ValueError("no examples to train on")
    rng = random.Random(seed)
    while True:
        order = examples[:]
        rng.shuffle(order)
        chunk = 64  # sort within chunks: little padding, still shuffled across the epoch
        groups = []
        for i in range(0, len(order), chunk):
            part = sorted(order[i:i + chunk], key=lambda e: len(e.input_ids))
            group: list[Example] = []
            for ex in part:
                width = max([len(ex.input_ids)] + [len(g.input_ids) for g in group])
                if group and width * (len(group) + 1) > batch_tokens:
                    groups.append(group)
                    group = []
                group.append(ex)
            if group:
                groups.append(group)
        rng.shuffle(groups)
        yield from groups


def collate(group: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(group), width), -100, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(group), width), dtype=torch.long)  # [B, T]
    decisions = torch.zeros((len(group), width), dtype=torch.bool)  # [B, T]: labels that are closing decisions
    for i, e in enumerate(group):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, e.prompt_len:n] = ids[i, e.prompt_len:n]
        mask[i, :n] = 1
        decisions[i, list(e.decisions)] = True
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "decisions": decisions}


def split_collate(group: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch cut one token before each response: left-padded contexts (every prompt token
    but the last) and right-padded tails (the last prompt token, then the response)."""
    contexts = [e.input_ids[: e.prompt_len - 1] for e in group]
    tails = [e.input_ids[e.prompt_len - 1:] for e in group]
    c, r = max(map(len, contexts)), max(map(len, tails))
    ids = torch.full((len(group), c + r), pad_id, dtype=torch.long)  # [B, C + R]
    mask = torch.zeros((len(group), c + r), dtype=torch.long)  # [B, C + R]
    labels = torch.full((len(group), r), -100, dtype=torch.long)  # [B, R]
    decisions = torch.zeros((len(group), r), dtype=torch.bool)  # [B, R]: labels that are closing decisions
    for i, (ctx, tail, e) in enumerate(zip(contexts, tails, group)):
        ids[i, c - len(ctx):c], ids[i, c:c + len(tail)] = torch.tensor(ctx), torch.tensor(tail)
        mask[i, c - len(ctx):c + len(tail)] = 1
        labels[i, 1:len(tail)] = ids[i, c + 1:c + len(tail)]
        decisions[i, [p - (e.prompt_len - 1) for p in e.decisions]] = True
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, C + R]: each row counts from its first token
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels,
            "decisions": decisions, "context": c}
