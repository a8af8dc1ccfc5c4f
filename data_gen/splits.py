"""Evaluation sets and the training pool (docs/design.md, "Contracts").

* ``bfcl450``: BFCL v3 ``exec_parallel`` (50) + ``parallel`` (200) + ``parallel_multiple`` (200).
* ``glaive650``: 650 Glaive conversations drawn with a seeded RNG, one eligible decision
  point drawn from each (sampled by conversation, as in the paper).
* ``bfcl450_structured``: the same requests as structured outputs — each answers with the
  arguments object of its first reference call, under that tool's parameter schema (strict),
  the tool-calling corpus's argument objects standing in for the schemas agents send.
* ``train``: every other request, minus any whose normalised user text equals an
  evaluation request's (and minus repeats of one text within the pool), so no evaluation
  request is ever trained on. Glaive conversations drawn for evaluation leave the pool whole.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

from data_gen.corpora import BFCL_SOURCE
from schemafill.contract.toolcall import ToolRequest, normalized_text

BFCL450_CATEGORIES = ("exec_parallel", "parallel", "parallel_multiple")
BFCL450_SIZE = 450
GLAIVE650_SIZE = 650


@dataclass
class Splits:
    eval_sets: dict[str, list[ToolRequest]]
    train: list[ToolRequest]
    stats: dict = field(default_factory=dict)


def bfcl450(bfcl: list[ToolRequest]) -> list[ToolRequest]:
    chosen = [r for r in bfcl if r.source == BFCL_SOURCE and r.category in BFCL450_CATEGORIES]
    if len(chosen) != BFCL450_SIZE:
        counts = Counter(r.category for r in chosen)
        raise ValueError(f"BFCL450 needs exactly {BFCL450_SIZE} requests, found {len(chosen)}: {dict(counts)}")
    return chosen


def structured_set(requests: list[ToolRequest]) -> list[ToolRequest]:
    """Each request with a reference call as a structured output: its messages, the first
    reference call's tool schema as the answer's schema, that call's arguments the reference."""
    out = []
    for r in requests:
        first = r.reference[0] if r.reference else None
        fn = next((f for f in r.functions if f["name"] == first.name), None) if first else None
        if fn is None:
            continue
        out.append(replace(r, id=f"{r.id}/structured", tools=[], reference=[first],
                           output={"name": fn["name"], "description": fn.get("description", ""),
                                   "schema": fn["parameters"], "strict": True}))
    return out


def glaive_eval(glaive: list[ToolRequest], size: int, seed: int) -> list[ToolRequest]:
    """One decision point from each of ``size`` conversations, both drawn with ``seed``."""
    by_conversation: dict[str, list[ToolRequest]] = defaultdict(list)
    for r in glaive:
        by_conversation[r.meta.get("conversation", r.id)].append(r)
    rng = random.Random(seed)
    conversations = sorted(by_conversation)
    picked = rng.sample(conversations, min(size, len(conversations)))
    return [rng.choice(by_conversation[c]) for c in picked]


def make_splits(bfcl: list[ToolRequest], glaive: list[ToolRequest], seed: int = 0,
                glaive_eval_size: int = GLAIVE650_SIZE) -> Splits:
    eval_sets = {"bfcl450": bfcl450(bfcl)}
    eval_sets["bfcl450_structured"] = structured_set(eval_sets["bfcl450"])  # the same texts: nothing new to hold out
    if glaive:
        eval_sets["glaive650"] = glaive_eval(glaive, glaive_eval_size, seed)
    eval_ids = {r.id for reqs in eval_sets.values() for r in reqs}
    eval_texts = {normalized_text(r.user_text()) for reqs in eval_sets.values() for r in reqs}
    eval_conversations = {r.meta["conversation"] for r in eval_sets.get("glaive650", []) if "conversation" in r.meta}

    train, seen = [], set()
    dropped = Counter()
    for r in [*bfcl, *glaive]:
        text = normalized_text(r.user_text())
        if r.id in eval_ids:
            if r.source != BFCL_SOURCE or r.category not in BFCL450_CATEGORIES:
                dropped["id_of_an_eval_request"] += 1  # a user record reusing an evaluation id
            continue
        if text in eval_texts or r.meta.get("conversation") in eval_conversations:
            dropped["overlaps_eval"] += 1
        elif text in seen:
            dropped["duplicate_text"] += 1
        else:
            seen.add(text)
            train.append(r)
    stats = {
        "eval": {name: len(reqs) for name, reqs in eval_sets.items()},
        "train": len(train),
        "train_by_source": dict(Counter(r.source for r in train)),
        "train_with_reference": sum(r.reference is not None for r in train),
        "dropped": dict(dropped),
    }
    return Splits(eval_sets=eval_sets, train=train, stats=stats)
