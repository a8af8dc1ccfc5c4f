"""The evaluation report: the paper's tables as Markdown, and its plots as PNG files.

Owns presentation only. Inputs are the eval stage's metrics
(``{dataset: {method: {...}}}``), its per-call-count breakdown and KV figures; every
function returns text or writes one image, so the report can be rebuilt from
``metrics.json`` alone.
"""

from __future__ import annotations

from pathlib import Path

ABLATION_STAGES = [  # (method, stage, what it adds) — paper Table 2
    ("schemafill_A", "A", "EAGLE-3 (SchemaFill budget)"),
    ("schemafill_B", "B", "+ schema-guided MAIN (forecast, structural packing, prompt-lookup copies)"),
    ("schemafill_C", "C", "+ SIDE drafting"),
    ("schemafill_D", "D", "+ cross-call packing (full SchemaFill)"),
]


def markdown(columns: list[str], rows: list[list]) -> str:
    def cell(v: object) -> str:
        return "—" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _num(v: float | None, digits: int = 2) -> str | None:
    return None if v is None else f"{v:.{digits}f}"


def _tps(m: dict) -> str:
    std = m.get("tps_std")
    return f"{m['tps']:.1f}" + (f" ± {std:.1f}" if std is not None else "")


def table1(metrics: dict[str, dict[str, dict]]) -> tuple[list[str], list[list]]:
    """End-to-end results: AL, TPS, speedup over AR, AR agreement, per dataset and method."""
    columns = ["Dataset", "Method", "AL", "E2E TPS", "Speedup", "AR agreement (%)", "Nodes/verify", "Requests"]
    rows = []
    for dataset, methods in metrics.items():
        for method, m in methods.items():
            if method in {a for a, _, _ in ABLATION_STAGES}:
                continue  # ablation stages have their own table
            agree = None if m.get("ar_agreement") is None else f"{100 * m['ar_agreement']:.2f}"
            speedup = None if m.get("speedup") is None else f"{m['speedup']:.2f}×"
            rows.append([dataset, method, _num(m["accept_length"]), _tps(m), speedup, agree,
                         _num(m["nodes_per_verify"], 1), m["requests"]])
    return columns, rows


def head_table(m: dict) -> tuple[list[str], list[list]]:
    """The draft head: held-out accuracy per horizon, and what it was trained on."""
    columns = ["Horizon", "Held-out accuracy", "Positions", "Train rows", "Epochs", "Draft vocabulary"]
    acc, positions = m.get("heldout_acc") or [], m.get("heldout_positions") or []
    return columns, [[k + 1, _num(a, 3), positions[k] if k < len(positions) else None, m.get("train_rows"),
                      m.get("epochs"), m.get("draft_vocab_size")] for k, a in enumerate(acc)]


def table2(methods: dict[str, dict]) -> tuple[list[str], list[list]]:
    """Ablation A–D on one dataset: AL, TPS, speedup over AR and over EAGLE-3."""
    columns = ["Stage", "Adds", "AL", "E2E TPS", "Speedup vs AR", "vs EAGLE-3"]
    eagle = methods.get("eagle3", {}).get("tps")
    rows = []
    for method, stage, adds in ABLATION_STAGES:
        fallback = {"A": "eagle3", "D": "schemafill"}.get(stage)  # the same decoder under its own name
        m = methods.get(method) or (methods.get(fallback) if fallback else None)
        if m is None:
            continue
        rows.append([stage, adds, _num(m["accept_length"]), _tps(m),
                     _num(m.get("speedup")), _num(m["tps"] / eagle) if eagle else None])
    return columns, rows


def table3(by_calls: dict[str, dict[str, dict]], method: str = "schemafill") -> tuple[list[str], list[list]]:
    """By the number of calls in AR's response: AL, TPS and nodes per verification."""
    columns = ["Calls", "Requests", "AL", "E2E TPS", "Nodes/verify", "EAGLE-3 AL"]
    rows = []
    for calls, methods in by_calls.items():
        m = methods.get(method)
        if m is None:
            continue
        e = methods.get("eagle3")
        rows.append([calls, m["requests"], _num(m["accept_length"]), f"{m['tps']:.1f}",
                     _num(m["nodes_per_verify"], 1), _num(e["accept_length"]) if e else None])
    return columns, rows


def table4(methods: dict[str, dict], bytes_per_row: int) -> tuple[list[str], list[list]]:
    """Per-request effective target KV (peak live rows) against AR's."""
    columns = ["Method", "KV rows / request", "KV MiB / request", "Increase vs AR"]
    ar = methods.get("ar", {}).get("kv_rows")
    rows = []
    for method, m in methods.items():
        kv = m.get("kv_rows")
        if kv is None:
            continue
        rows.append([method, f"{kv:.0f}", f"{kv * bytes_per_row / 2**20:.2f}",
                     f"{100 * (kv / ar - 1):+.2f}%" if ar else None])
    return columns, rows


def table5(m: dict) -> tuple[list[str], list[list]]:
    """SchemaFill's time by phase (initialisation, i.e. the prompt's prefill, apart)."""
    columns = ["Phase", "Total (s)", "Mean (ms/request)", "Share of the four phases (%)"]
    times = m.get("time_breakdown") or {}
    four = sum(times.get(k, 0.0) for k in ("forecast", "drafting", "verification", "other")) or 1.0
    names = {"forecast": "BM25 tool forecast", "drafting": "EAGLE-3 drafting", "verification": "Target verification",
             "other": "Other generation", "initialisation": "Initialisation (prefill + candidates)"}
    rows = []
    for key, name in names.items():
        if key in times:
            share = None if key == "initialisation" else f"{100 * times[key] / four:.2f}"
            rows.append([name, f"{times[key]:.3f}", f"{1000 * times[key] / max(m['requests'], 1):.2f}", share])
    return columns, rows


def cost_section(methods: dict[str, dict]) -> list[str]:
    """Markdown lines on how the launch chose its nodes: the measured verification-cost curve
    (``decode.select=cost``) or the fixed budget, and each method's host-side ms per round."""
    chosen = {m: v["selection"] for m, v in methods.items() if v.get("selection")}
    if not chosen:
        return []
    curve = next((s["cost_model"] for s in chosen.values() if s.get("cost_model")), None)
    if curve is None:
        return ["Node selection: fixed budget (`decode.select=fixed`): every drafted node is verified.", ""]
    points = ", ".join(f"c({n}) = {ms:.1f}" for n, ms in zip(curve["sizes"], curve["ms"]))
    hosts = ", ".join(f"{m} {s['host_ms']:.1f}" for m, s in chosen.items())
    return ["Node selection: cost-aware (`decode.select=cost`): each round verifies the candidates whose expected "
            "accepted tokens are worth their measured cost.", "",
            f"Verification cost measured on `{curve['key']}` at {curve['context']} positions: {points} ms; "
            f"linear fit {curve['fit_ms']:.1f} + {curve['fit_ms_per_row']:.2f}·n ms. "
            f"Host-side ms per round (drafting, packing, selection): {hosts}.", ""]


def table6(sampled: dict[str, dict[str, dict]]) -> tuple[list[str], list[list]]:
    """Sampling: AL, TPS and speedup over AR at the same temperature, per dataset."""
    columns = ["Dataset", "Method", "AL", "E2E TPS", "Speedup"]
    rows = [[d, m, _num(v["accept_length"]), _tps(v), None if v.get("speedup") is None else f"{v['speedup']:.2f}×"]
            for d, methods in sampled.items() for m, v in methods.items()]
    return columns, rows


LABELS = {"none": "free", "prune": "free, pruned drafts", "schema": "schema"}  # decode.constrain


def table7(compared: dict[str, dict[str, dict[str, dict]]]) -> tuple[list[str], list[list]]:
    """Free vs schema-constrained decoding (``{dataset: {decode.constrain: {method: metrics}}}``,
    the free side being ``none`` or ``prune``):
    valid calls, AL with and without forced tokens, TPS, speedup over AR in the same mode,
    and the TPS ratio of each constrained method to its free self."""
    columns = ["Dataset", "Method", "Decoding", "Valid calls (%)", "AL", "AL w/o forced", "E2E TPS",
               "Speedup vs AR", "TPS vs free", "Agrees with AR (%)"]
    rows = []
    for d, modes in compared.items():
        free = next((ms for mode, ms in modes.items() if mode != "schema"), {})
        for method in free.keys() | modes.get("schema", {}).keys():
            for mode in sorted(modes, key=lambda k: k == "schema"):
                m = modes[mode].get(method)
                if m is None:
                    continue
                base = free.get(method, {}).get("tps")
                rows.append([d, method, LABELS.get(mode, mode),
                             None if m.get("valid_rate") is None else f"{100 * m['valid_rate']:.1f}",
                             _num(m["accept_length"]), _num(m.get("decided_al")), _tps(m),
                             None if m.get("speedup") is None else f"{m['speedup']:.2f}×",
                             f"{m['tps'] / base:.2f}×" if base and mode == "schema" else None,
                             None if m.get("ar_agreement") is None else f"{100 * m['ar_agreement']:.1f}"])
    order = {"ar": 0, "eagle3": 1, "toolspec": 2, "ngram": 3, "suffix": 4, "schemafill": 5}
    rows.sort(key=lambda r: (r[0], order.get(r[1], 9), r[1], r[2]))
    return columns, rows


def bar_plot(values: dict[str, float], ylabel: str, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(values)), 3.2))
    bars = ax.bar(list(values), list(values.values()), color="#4C72B0")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(series: dict[str, dict[str, float]], xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    for name, points in series.items():
        ax.plot(list(points), list(points.values()), marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
