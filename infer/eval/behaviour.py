"""Behaviour records of every decoder, and their comparison: the check that a reshaping of
the decoding code changed nothing a user could see.

    python -m infer.eval.behaviour record outputs/behaviour/before.json          # on main, before
    python -m infer.eval.behaviour record outputs/behaviour/after.json           # on the branch
    python -m infer.eval.behaviour compare outputs/behaviour/before.json outputs/behaviour/after.json

A record holds, for every mode (greedy; ``decode.constrain=schema``; sampled at temperature
1) and every method of that mode, each request's response tokens, stop reason, target calls
and nodes verified per round, on ``--limit`` requests spread over BFCL450, decoded with the
`make run` target and head. Speed is left out: two launches never time alike. So is
everything that depends on it: the records price a round's host-side work at a fixed
``decode.host_ms`` rather than the measured one, and read the cost curve from the host's cache
(the curve each mode used is recorded, and compared first). ``compare`` names every request
whose record differs and exits 1 when any does. A mode already recorded
in the output file is kept, so an interrupted ``record`` resumes at the next mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schemafill import atomic

ABLATIONS = ["schemafill_A", "schemafill_B", "schemafill_C", "schemafill_D"]
MODES: dict[str, tuple[list[str], list[str]]] = {  # mode → (methods, decode overrides)
    "greedy": (["ar", "eagle3", "eagle3_wide", "toolspec", "parallel_fill", *ABLATIONS], []),
    "constrained": (["ar", "eagle3", "toolspec", "schemafill"], ["decode.constrain=schema"]),
    "sampled": (["ar", "eagle3", "toolspec", "schemafill"], ["decode.temperature=1.0"]),
}
FIELDS = ("output_ids", "stop", "target_calls", "nodes", "forced", "pruned")  # what must not change
# the host-side ms per round selection assumes in a record (of the order of SchemaFill's own on a CPU)
HOST_MS = 25.0


def record(out: Path, artifacts: Path, model: str, head: Path | None, limit: int, modes: list[str]) -> dict:
    from infer.eval.launch import run
    from schemafill.config import InferConfig, compose_config

    requests = artifacts / "requests" / "bfcl450.jsonl"
    head = head or artifacts / "heads" / model
    for path in (requests, head / "config.json"):
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: run `make run` (or pass --artifacts/--head) first")
    done = json.loads(out.read_text()) if out.is_file() else {}
    if done and done.get("limit") != limit:  # modes of other requests would compare as missing or changed
        raise ValueError(f"{out} was recorded with --limit {done.get('limit')}, not {limit}: use another file")
    for mode in modes:
        if mode in done.get("modes", {}):
            print(f"[behaviour] {mode}: recorded already in {out}")
            continue
        methods, overrides = MODES[mode]
        cfg = compose_config("infer", [
            f"model={model}", f"paths.artifacts={artifacts}", f"requests={requests}", f"head={head}",
            f"methods=[{','.join(methods)}]", f"limit={limit}", "warmup=0", "logger=none",
            f"out={out.parent / f'.{out.stem}_{mode}'}", f"decode.host_ms={HOST_MS}", *overrides], InferConfig)
        print(f"[behaviour] {mode}: {', '.join(methods)} on {limit} requests")
        result = run(cfg)
        done.setdefault("modes", {})[mode] = {
            m: {f"{r['id']}#{r['sample']}": {k: r[k] for k in FIELDS} for r in rs} for m, rs in result["rows"].items()}
        done.setdefault("cost_model", {})[mode] = next(
            (v["selection"]["cost_model"] for v in result["metrics"].values() if "selection" in v), None)
        done["limit"] = limit
        atomic.write_json(out, done)  # after every mode: an interrupted record resumes here
    return done


def differences(before: dict, after: dict) -> tuple[int, list[str]]:
    """(requests compared, one line per difference) between two records."""
    lines, compared = [], 0
    curves = after.get("cost_model", {})
    for mode, curve in before.get("cost_model", {}).items():
        if _priced(curves.get(mode)) != _priced(curve):  # selection was priced otherwise: nodes may move
            lines.append(f"{mode}: the cost curves differ ({_short(curve)} -> {_short(curves.get(mode))}): "
                         f"record both on one host, with one thread count and its cached curve")
    for mode, methods in before["modes"].items():
        if mode not in after["modes"]:
            lines.append(f"{mode}: not in the second record")
            continue
        for method, rows in methods.items():
            other = after["modes"][mode].get(method)
            if other is None:
                lines.append(f"{mode}/{method}: not in the second record")
                continue
            for key, row in rows.items():
                compared += 1
                if key not in other:
                    lines.append(f"{mode}/{method}/{key}: not in the second record")
                    continue
                changed = [f for f in FIELDS if row[f] != other[key][f]]
                if changed:
                    lines.append(f"{mode}/{method}/{key}: " + ", ".join(
                        f"{f} {_short(row[f])} -> {_short(other[key][f])}" for f in changed))
    return compared, lines


def _priced(curve: dict | None) -> dict | None:
    """What selection reads of a recorded cost curve: its points, not the key naming the kernels
    it was timed on (a change that renames them changes the key, not the prices)."""
    return None if curve is None else {k: v for k, v in curve.items() if k != "key"}


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode and write a behaviour record")
    rec.add_argument("out", type=Path, help="the record to write (JSON); modes already in it are kept")
    rec.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="the pipeline's artifacts folder")
    rec.add_argument("--model", default="smollm2-135m", help="the target's config name")
    rec.add_argument("--head", type=Path, default=None, help="head folder (default: artifacts/heads/<model>)")
    rec.add_argument("--limit", type=int, default=30, help="requests, spread evenly over BFCL450")
    rec.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    cmp_ = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
        record(args.out, args.artifacts, args.model, args.head, args.limit, modes)
        print(f"[behaviour] wrote {args.out}")
        return 0
    compared, lines = differences(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    for line in lines:
        print(line)
    print(f"[behaviour] {compared} (mode, method, request) records compared, {len(lines)} differ")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
