"""Forward bench: what one target call of n rows costs, beside what the host's memory allows.

    python benchmarks/forward_bench.py [--target artifacts/targets/smollm2-135m] [--out outputs/bench/forward.json]
    make bench-forward

For each precision, context and row count, the runtime's ``Target.forward`` (the call every
decoder makes: n new rows after ``context`` committed positions, logits at every row, as a
verification computes them) and the ``transformers`` model's own forward on the same shapes
(SDPA, a ``DynamicCache`` holding the context, cropped back after each call), timed in turn
round after round. Beside them the host's read bandwidth (a sum over 1 GiB) and the bound it
sets: streaming every weight a forward reads once. Prints a table with c(32) / c(1) (how
many rows a verification can afford) and writes JSON with the host.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from infer.pricing.cost_model import verification_calls
from schemafill import atomic
from schemafill.runtime import host
from schemafill.runtime.loading import load_target
from schemafill.runtime.model import Target
from schemafill.runtime.timing import alternating_ms, median_ms

SIZES = (1, 4, 16, 32, 64)
CONTEXTS = (128, 512, 1536)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of reading a ``gib``-GiB fp32 tensor once (a ``sum``), median of ``repeats``."""
    x = torch.ones(int(gib * 2**30) // 4)
    return x.numel() * 4 / median_ms(x.sum, torch.device("cpu"), repeats) / 1e6


def streamed_bytes(target: Target) -> int:
    """Bytes of the weights one forward reads: all but the input embedding, whose rows are
    gathered (a tied LM head still reads it whole). ``parameters()`` yields a tied weight once."""
    embed = target.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in target.parameters()
               if p is not embed or target.config.tie_word_embeddings)


def theirs(model, context: int, sizes: tuple[int, ...]) -> list:
    """Calls of the ``transformers`` model's forward on the same shapes, its cache kept at ``context``."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, context + max(sizes)), generator=g)
    cache = DynamicCache()
    with torch.inference_mode():
        model(tokens[:, :context], cache=cache, use_cache=True)

    def call(n: int) -> None:
        with torch.inference_mode():
            model(tokens[:, context:context + n], cache=cache, use_cache=True)
        cache.crop(-n)  # back to the context: every call sees the same cache

    return [lambda n=n: call(n) for n in sizes]


def run(folder: Path, dtypes: list[torch.dtype], contexts: tuple[int, ...], sizes: tuple[int, ...], repeats: int,
        with_hf: bool) -> dict:
    from transformers import AutoModelForCausalLM

    bandwidth = read_bandwidth()
    rows = []
    for dtype in dtypes:
        target = load_target(folder, dtype, torch.device("cpu"))
        bound_ms = streamed_bytes(target) / bandwidth / 1e6
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval() \
            if with_hf else None
        for context in contexts:
            calls = verification_calls(target, context, sizes) + (theirs(model, context, sizes) if with_hf else [])
            ms = alternating_ms(calls, torch.device("cpu"), repeats)
            for i, n in enumerate(sizes):
                hf = ms[len(sizes) + i] if with_hf else None
                rows.append({"dtype": str(dtype).removeprefix("torch."), "context": context, "rows": n,
                             "ours_ms": round(ms[i], 2), "hf_ms": None if hf is None else round(hf, 2),
                             "bound_ms": round(bound_ms, 2), "x_bound": round(ms[i] / bound_ms, 2),
                             "backend": target.runs_on().summary()})
        del target, model
    return {"host": host.summary(), "read_gb_s": round(bandwidth, 1), "target": str(folder), "rows": rows}


def table(result: dict) -> str:
    lines = [f"read bandwidth {result['read_gb_s']} GB/s on {result['host']['cpu_model']} "
             f"({result['host']['cpu_capability']}, {result['host']['torch_threads']} threads)",
             f"{'dtype':9} {'context':>7} {'rows':>5} {'ours ms':>8} {'hf ms':>8} {'bound':>7} {'×bound':>7}"]
    for r in result["rows"]:
        hf = "—" if r["hf_ms"] is None else f"{r['hf_ms']:.1f}"
        lines.append(f"{r['dtype']:9} {r['context']:7d} {r['rows']:5d} {r['ours_ms']:8.1f} {hf:>8} "
                     f"{r['bound_ms']:7.1f} {r['x_bound']:7.2f}")
    for (dtype, context), c in slopes(result["rows"]).items():
        lines.append(f"{dtype} at {context}: c(32) / c(1) = {c:.2f}")
    return "\n".join(lines)


def slopes(rows: list[dict]) -> dict:
    """c(32) / c(1) per (dtype, context), where both were measured."""
    by = {(r["dtype"], r["context"], r["rows"]): r["ours_ms"] for r in rows}
    return {(d, c): by[(d, c, 32)] / by[(d, c, 1)] for d, c, n in by if n == 1 and (d, c, 32) in by}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="a Hugging Face folder (default: the make-run target, else its base)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="leave out the transformers forward")
    parser.add_argument("--out", default="outputs/bench/forward.json")
    args = parser.parse_args()
    folder = Path(args.target) if args.target else next(
        (p for p in (Path("artifacts/targets/smollm2-135m"), Path("artifacts/targets/smollm2-135m-base"))
         if (p / "config.json").is_file()), None)
    if folder is None or not (folder / "config.json").is_file():
        raise SystemExit("no target to time: pass --target <Hugging Face folder>, or run `make run` first")
    result = run(folder, [getattr(torch, d) for d in args.dtypes.split(",")],
                 tuple(int(c) for c in args.contexts.split(",")), tuple(int(s) for s in args.sizes.split(",")),
                 args.repeats, not args.no_hf)
    print(table(result))
    atomic.write_json(Path(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
