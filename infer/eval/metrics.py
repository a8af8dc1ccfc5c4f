"""Per-method metrics pooled over requests (``metrics.json``; the counters of docs/design.md,
"Lossless, and what a request costs").

AL is Σtokens / Σtarget calls, TPS Σtokens / Σseconds (one request at a time) or Σtokens /
the wall time (requests decoded together, ``concurrency`` > 1), AR agreement the share of
requests whose tokens equal AR's (the lossless check at temperature 0).
"""

from __future__ import annotations

from collections import defaultdict


def pooled(rows: list[dict], reference: dict[str, list[int]] | None, wall: float | None = None) -> dict:
    """``wall``: seconds the rows took together, when they were decoded in one batch (their
    ``seconds`` are then latencies, which overlap)."""
    tokens = sum(len(r["output_ids"]) for r in rows)
    calls = sum(r["target_calls"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    verifies = [n for r in rows for n in r["nodes"]]
    agree = None if reference is None else sum(r["output_ids"] == reference[r["id"]] for r in rows) / max(len(rows), 1)
    times: dict[str, float] = {}
    for r in rows:
        for k, v in r["times"].items():
            times[k] = times.get(k, 0.0) + v
    forced = sum(r.get("forced", 0) for r in rows)
    return {"accept_length": tokens / calls if calls else None,
            # forced tokens cost no target decision: AL without them counts only what the target chose
            "decided_al": (tokens - forced) / calls if calls else None, "forced": forced,
            "pruned": sum(r.get("pruned", 0) for r in rows),
            "valid_rate": sum(r["valid"] for r in rows) / len(rows) if rows and "valid" in rows[0] else None,
            "tps": tokens / max(wall if wall is not None else seconds, 1e-9), "ar_agreement": agree,
            "wall_seconds": None if wall is None else round(wall, 3),
            "tokens": tokens, "target_calls": calls, "seconds": round(seconds, 3), "requests": len(rows),
            "nodes_per_verify": sum(verifies) / max(len(verifies), 1),
            "init_nodes": sum(r["init_nodes"] for r in rows) / max(len(rows), 1),
            "kv_rows": sum(r["kv_rows"] for r in rows) / len(rows) if rows and all(r["kv_rows"] for r in rows) else None,
            "time_breakdown": {k: round(v, 3) for k, v in times.items()}}


def by_category(rows: dict[str, list[dict]], category: dict[str, str], reference: dict[str, list[int]] | None,
                alone: bool) -> dict[str, dict[str, dict]]:
    """Per method, each request category's requests, AL, AR agreement and seconds; ``x_ar``
    (AR's seconds over the method's, on the same requests) where they were decoded one at a
    time (``alone``: decoded together, a request's seconds overlap the others')."""
    split: dict[str, dict[str, list[dict]]] = {m: defaultdict(list) for m in rows}
    for m, rs in rows.items():
        for r in rs:
            split[m][category[r["id"]]].append(r)
    out: dict[str, dict[str, dict]] = {}
    for m, groups in split.items():
        out[m] = {}
        for c, rs in sorted(groups.items()):
            p = pooled(rs, reference)
            ar, seconds = split.get("ar", {}).get(c), sum(r["seconds"] for r in rs)
            out[m][c] = {k: p[k] for k in ("requests", "accept_length", "ar_agreement", "seconds")} | {
                "x_ar": round(sum(r["seconds"] for r in ar) / seconds, 3) if alone and ar and seconds else None}
    return out
