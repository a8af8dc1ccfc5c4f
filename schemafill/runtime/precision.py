"""Precision chosen by measuring, not by CPU flags.

The same flags mean opposite things on different CPUs: hosts that both report AVX512-BF16
have run the built-in target's shapes 5x faster and 1.5x slower in bf16 than in fp32, and an
AVX2-only host emulates bf16 about 30x slower. So on a CPU, ``auto`` times the operations that
matter in both precisions and takes the faster:

* ``train`` — one step of a target-shaped block (attention projections and the MLP) over
  ``tokens`` rows, forward and backward: fp32 against bf16 autocast (the fine-tune's shapes);
* ``decode`` — the forwards decoding makes: one row (an AR step) plus ``rows`` rows (a
  verification) through the same block and the LM head, fp32 weights against bf16 ones (some
  CPUs run one-row bf16 products far slower than larger ones, so both count).

bf16 is chosen only when it is at least ``MARGIN`` faster (it costs precision; a tie is not
worth it). A probe takes a few seconds; its result is cached per host, torch build, thread
count, ISA caps and shape (``$XDG_CACHE_HOME/schemafill/precision``), like the cost curve. A
CUDA device computes bf16 natively where it has it: no probe. ``true`` / ``false`` force it.
Training and decoding may choose differently. Verifying decoders keep fp32 on a CPU whatever
the decode probe says (``schemafill.runtime.loading.decode_choice``): the probe only says what is fast.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from schemafill.runtime import host, host_cache
from schemafill.runtime.timing import alternating_ms

MARGIN = 0.9  # bf16 must take at most this fraction of fp32's time
SETTINGS = ("auto", "true", "false")
KINDS = ("train", "decode")


@dataclass(frozen=True)
class Precision:
    bf16: bool
    why: str
    fp32_ms: float | None = None  # the probe's timings (None: not probed)
    bf16_ms: float | None = None
    cached: bool = False  # read from the host's cache

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    def summary(self) -> dict:
        return asdict(self)


def choose(fp32_ms: float, bf16_ms: float, margin: float = MARGIN) -> tuple[bool, str]:
    """bf16 when it takes at most ``margin`` of fp32's time (pure: the probe's timings come in)."""
    bf16 = bf16_ms <= margin * fp32_ms
    return bf16, f"timed probe: bf16 {bf16_ms:.1f} ms, fp32 {fp32_ms:.1f} ms ({bf16_ms / fp32_ms:.2f}x): " \
                 f"{'bf16' if bf16 else 'fp32'}"


@dataclass(frozen=True)
class Shape:
    """What the probe computes: a block of a target with these sizes."""

    hidden: int
    intermediate: int
    kv_hidden: int  # the key/value projections' width (grouped-query attention)
    vocab: int  # the LM head's rows (decode only)
    rows: int  # tokens per step (train) or per verification (decode)

    @classmethod
    def of(cls, config, rows: int) -> "Shape":
        """The shape of a Hugging Face config's layer (``hidden_size``, ``intermediate_size``, ...)."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, config.hidden_size // heads * kv, config.vocab_size,
                   rows)


def _weights(shape: Shape, lm_head: bool, generator: torch.Generator) -> list[torch.Tensor]:
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_hidden
    sizes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] + ([(shape.vocab, h)] if lm_head else [])
    return [torch.randn(o, n, generator=generator) * n ** -0.5 for o, n in sizes]


def _block(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The probe's work: attention projections, then a SwiGLU MLP (and an LM head, if given)."""
    linear, silu = torch.nn.functional.linear, torch.nn.functional.silu
    q, k, v = linear(x, w[0]), linear(x, w[1]), linear(x, w[2])
    x = x + linear(q + k.repeat(1, q.shape[1] // k.shape[1]) + v.repeat(1, q.shape[1] // v.shape[1]), w[3])
    x = x + linear(silu(linear(x, w[4])) * linear(x, w[5]), w[6])
    return linear(x, w[7]) if len(w) > 7 else x


def probe(kind: str, shape: Shape, repeats: int = 5) -> tuple[float, float]:
    """Median milliseconds of the ``kind`` probe in fp32 and in bf16, on the CPU. The two
    precisions alternate, so a host busy with something else slows both alike."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.rows, shape.hidden, generator=g)
    if kind == "train":
        weights = [w.requires_grad_() for w in _weights(shape, False, g)]

        def step(bf16: bool) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = _block(x, weights)
            out.float().square().mean().backward()

        calls = [lambda: step(False), lambda: step(True)]
    elif kind == "decode":
        fp32 = _weights(shape, True, g)
        bf16 = [w.to(torch.bfloat16) for w in fp32]
        low = x.to(torch.bfloat16)

        def forwards(w: list[torch.Tensor], rows: torch.Tensor) -> None:
            with torch.inference_mode():
                _block(rows[:1], w)  # an AR step
                _block(rows, w)  # a verification

        calls = [lambda: forwards(fp32, x), lambda: forwards(bf16, low)]
    else:
        raise ValueError(f"probe kind must be one of {KINDS}, got {kind!r}")
    fp32_ms, bf16_ms = alternating_ms(calls, torch.device("cpu"), repeats)
    return fp32_ms, bf16_ms


def host_key(kind: str, shape: Shape) -> str:
    """What the probe's timings depend on."""
    return "|".join([kind, json.dumps(asdict(shape), sort_keys=True), *host.timing_key()])


def default_cache() -> Path:
    return host_cache.folder("precision")


def decide(setting: str, kind: str, device: torch.device, shape: Shape, cache_dir: Path | None = None) -> Precision:
    """The precision of ``kind`` work on ``device`` under ``setting`` (auto | true | false)."""
    setting = str(setting).lower()
    if setting not in SETTINGS:
        raise ValueError(f"a precision setting must be one of {SETTINGS}, got {setting!r}")
    if device.type == "cuda":  # the setting is the CPU's: a GPU computes bf16 natively or not at all
        ok = torch.cuda.is_bf16_supported()
        return Precision(ok, "CUDA bf16" if ok else "this GPU has no bf16")
    if setting != "auto":
        return Precision(setting == "true", f"forced ({setting})")
    key = host_key(kind, shape)
    path = host_cache.entry(cache_dir or default_cache(), key)
    saved = host_cache.read(path, key)
    try:
        if saved is not None:
            bf16, why = choose(saved["fp32_ms"], saved["bf16_ms"])
            return Precision(bf16, why + " (cached)", saved["fp32_ms"], saved["bf16_ms"], cached=True)
    except (KeyError, TypeError):
        pass  # a damaged entry: measured again
    fp32_ms, bf16_ms = probe(kind, shape)
    host_cache.write(path, key, {"fp32_ms": round(fp32_ms, 3), "bf16_ms": round(bf16_ms, 3)}, "the precision probe")
    bf16, why = choose(fp32_ms, bf16_ms)
    return Precision(bf16, why, round(fp32_ms, 3), round(bf16_ms, 3))
