"""Multi-call compositions: several single requests joined into one user turn whose
reference is the concatenation of their calls.

BFCL's evaluation sets are multi-call; most training requests are not. Composing 2–4
training requests (sometimes of one tool, sometimes of different tools) teaches the built-in
target to answer with parallel calls (stage `target`) and shows the draft head multi-call
responses (stage `continuations`). Pure: standard library only.
"""

from __future__ import annotations

import random
from collections import defaultdict

from schemafill.contract.toolcall import ToolRequest


def composable(requests: list[ToolRequest]) -> list[ToolRequest]:
    """Requests that can be parts: one user message and a known, non-empty reference."""
    return [r for r in requests if r.reference and len(r.messages) == 1 and r.messages[0]["role"] == "user"]


def compose(parts: list[ToolRequest], rid: str, rng: random.Random) -> ToolRequest | None:
    """One request doing every part's work, or None when their catalogs conflict."""
    tools: dict[str, dict] = {}
    for part in parts:
        for tool in part.tools:
            name = tool["function"]["name"]
            if name in tools and tools[name] != tool:
                return None  # one name, two schemas: the composed catalog would be ambiguous
            tools[name] = tool
    catalog = list(tools.values())
    rng.shuffle(catalog)  # the first tool listed must not give away the first call
    text = "\n".join(p.messages[0]["content"].strip() for p in parts)
    return ToolRequest(
        id=rid, messages=[{"role": "user", "content": text}], tools=catalog, source="composed",
        category=f"composed_{len(parts)}", reference=[c for p in parts for c in p.reference],
        meta={"parts": [p.id for p in parts]},
    )


def compositions(requests: list[ToolRequest], count: int, seed: int, prefix: str = "composed",
                 same_tool_share: float = 0.5, sizes: tuple[int, ...] = (2, 3, 4),
                 max_catalog: int | None = None) -> list[ToolRequest]:
    """``count`` compositions drawn with ``seed``; about ``same_tool_share`` reuse one tool.

    ``sizes`` is drawn from uniformly (repeat a size to weight it); ``max_catalog`` keeps
    parts with at most that many tools, so composed prompts stay short enough to train on.
    """
    pool = composable(requests)
    if max_catalog is not None:
        pool = [r for r in pool if len(r.tools) <= max_catalog]
    if len(pool) < max(sizes):
        return []
    by_tool: dict[str, list[ToolRequest]] = defaultdict(list)
    for r in pool:
        names = {c.name for c in r.reference}
        if len(names) == 1:
            by_tool[names.pop()].append(r)
    shared = [group for group in by_tool.values() if len(group) >= min(sizes)]
    rng = random.Random(seed)
    out: list[ToolRequest] = []
    attempts = 0
    while len(out) < count and attempts < 20 * count:
        attempts += 1
        k = rng.choice(sizes)
        if shared and rng.random() < same_tool_share:
            group = rng.choice(shared)
            parts = rng.sample(group, min(k, len(group)))
        else:
            parts = rng.sample(pool, k)
        if len({p.id for p in parts}) < len(parts):
            continue
        composed = compose(parts, f"{prefix}_{len(out)}", rng)
        if composed is not None:
            out.append(composed)
    return out
