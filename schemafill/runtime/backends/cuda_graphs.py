"""CUDA graphs for a target's decode and verification calls.

An eager forward of a 7B target issues some 700 kernels; on a GPU issuing them takes longer
than running them, so a one-row call costs what a 128-row one does and neither is near the
weights' read time. A call replayed from a CUDA graph issues them as one. A graph fixes every
tensor's shape and address, so three things make one graph serve many calls:

* **Buckets.** A call's rows are padded up to a row bucket, its requests (parts) to a part
  bucket, and the slots a part may see to a width bucket: one graph per
  ``(rows, parts, width)``, captured the first time that shape is seen.
* **One KV pool.** Every one-row arena the target hands out (``Target.new_arena``) is a row of
  one KV tensor per layer (``ArenaPool``), so a graph reads any request's keys and values by a
  pool row index held in a static input, not by the address it was captured with. Part p's
  slots become columns ``[p·W, p·W + S_p)`` of the call's gathered keys, and one attention
  call serves every part under a block-diagonal mask.
* **Padding that sees and changes nothing real.** Padded rows write their keys and values to
  the pool's scratch row (row 0, never handed out) and see one column; padded parts gather the
  scratch row and are masked for everyone. A real row's logits, features and KV are those of
  the unpadded call: rows interact only through attention, and no real row sees a padded one.

The EAGLE-3 head's draft steps are bucketed the same way over a pool of their own
(``HeadGraphs``). Calls the buckets do not cover (a prefill longer than the largest row bucket,
an arena not from the pool, a batch-row ``Target.forward``) run on the eager backend. Without
CUDA nothing is captured: ``CudaGraphs(target, eager, capture=False)`` runs the same padded
calls eagerly, which is how the CPU tests check everything but the capture itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from schemafill.runtime.backends.eager import Eager
from schemafill.runtime.calls import DraftSteps, Forward, Part, Product
from schemafill.runtime.drafter import Eagle3Head
from schemafill.runtime.layers import apply_rotary_rolled, attend, mask_bias, plain
from schemafill.runtime.model import Target
from schemafill.runtime.storage import ArenaPool, KVArena, width_bucket

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # more rows (a long prefill) run eagerly
PART_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``n``, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class Gathered:
    """The attention of a bucketed call: every row writes its keys and values to its pool row
    and slot, then all rows attend at once over the parts' pool rows gathered side by side,
    ``width`` slots each: ``Target.run``'s ``attend``."""

    pool: ArenaPool
    write_rows: torch.Tensor  # [R] the pool row each call row writes (0: scratch)
    write_slots: torch.Tensor  # [R]
    gather: torch.Tensor  # [P] the pool row of each part (0 for a padded part)
    width: int
    bias: torch.Tensor  # [1, R, P·width] additive
    fold: bool = False  # one-token queries folded into KV-head rows (the eager backend's choice)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        # q: [1, Hq, R, hd]; k, v: [1, Hkv, R, hd]; cos, sin: [1, 1, R, hd]
        return self.attend(layer, apply_rotary_rolled(q, cos, sin), apply_rotary_rolled(k, cos, sin), v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # rotated q: [1, Hq, R, hd]; k, v: [1, Hkv, R, hd] -> [1, Hq, R, hd]
        keys, values = self.pool.k[layer], self.pool.v[layer]  # [rows, Hkv, C, hd]
        keys[self.write_rows, :, self.write_slots] = k[0].transpose(0, 1)  # [R, Hkv, hd]
        values[self.write_rows, :, self.write_slots] = v[0].transpose(0, 1)
        hkv, hd = keys.shape[1], keys.shape[3]
        side_by_side = [t[self.gather, :, :self.width].transpose(0, 1).reshape(1, hkv, -1, hd) for t in (keys, values)]
        return attend(q, *side_by_side, self.bias, None, self.fold)


@dataclass
class Bucketed:
    """One bucket's static inputs, and its captured graph with the outputs it writes."""

    tokens: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    write_rows: torch.Tensor  # [R]
    write_slots: torch.Tensor  # [R]
    logits_at: torch.Tensor  # [R]: rows whose logits are read, padded with row 0
    gather: torch.Tensor  # [P]
    visible: torch.Tensor  # [R, P·W] boolean
    width: int
    hidden: torch.Tensor | None = None  # [R, H]: the head's input features
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    out: Any = None  # the graph's outputs (overwritten by each replay)
    capture_s: float = 0.0

    @classmethod
    def empty(cls, rows: int, parts: int, width: int, device: torch.device,
              hidden: tuple[int, torch.dtype] | None = None) -> "Bucketed":
        z = [torch.zeros(rows, dtype=torch.long, device=device) for _ in range(5)]
        features = None if hidden is None else torch.zeros(rows, hidden[0], dtype=hidden[1], device=device)
        return cls(*z, torch.zeros(parts, dtype=torch.long, device=device),
                   torch.zeros(rows, parts * width, dtype=torch.bool, device=device), width, features)

    def load(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part], pool_rows: list[int],
             logits_at: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """The call's inputs into the static ones, padded (module docstring); ``pool_rows``: each
        part's row of the pool."""
        n, rows, count = tokens.shape[0], self.tokens.shape[0], self.gather.shape[0]
        # what the host knows, in one copy: each row's pool row and each part's (padding: the
        # scratch row), and without ``logits_at`` every row's logits
        owners = [r for p, r in zip(parts, pool_rows) for _ in range(p.stop - p.start)]
        every = list(range(n)) + [0] * (rows - n) if logits_at is None else []
        known = torch.tensor(owners + [0] * (rows - n) + pool_rows + [0] * (count - len(parts)) + every)
        self.write_rows.copy_(known[:rows])
        self.gather.copy_(known[rows:rows + count])
        if logits_at is None:
            self.logits_at.copy_(known[rows + count:])
        else:
            self.logits_at[:logits_at.shape[0]], self.logits_at[logits_at.shape[0]:] = logits_at, 0
        self.tokens[:n], self.tokens[n:] = tokens, 0
        self.positions[:n], self.positions[n:] = positions, 0
        if hidden is not None:
            self.hidden[:n], self.hidden[n:] = hidden, 0
        self.write_slots[:n], self.write_slots[n:] = torch.cat([p.slots for p in parts]), 0
        visible = torch.zeros_like(self.visible)
        for i, p in enumerate(parts):
            s = p.visibility.shape[-1]
            visible[p.start:p.stop, i * self.width:i * self.width + s] = p.visibility
        visible[n:, 0] = True  # a padded row sees one column, so its softmax is defined
        self.visible.copy_(visible)

    def gathered(self, pool: ArenaPool, dtype: torch.dtype, fold: bool) -> Gathered:
        return Gathered(pool, self.write_rows, self.write_slots, self.gather, self.width,
                        mask_bias(self.visible, dtype)[None], fold)


@dataclass
class Runner:
    """Bucketed calls of one model over one KV pool, each bucket's ``step`` captured as a CUDA
    graph when ``capture``, else run eagerly over the same padded inputs."""

    pool_shape: tuple[int, int, int]  # layers, KV heads, head dim
    dtype: torch.dtype
    device: torch.device
    capture: bool
    step: Callable[[Bucketed, Gathered], Any]  # the model's call over a bucket's static inputs
    hidden_size: int = 0  # rows carry input features of this width (the head's)
    fold: bool = False
    pool: ArenaPool | None = None
    calls: dict[tuple[int, int, int], Bucketed] = field(default_factory=dict)
    generation: int = 0
    replays: int = 0
    eager: int = 0
    mempool: Any = None

    def arena(self, capacity: int) -> KVArena:
        """A one-row arena of at least ``capacity`` slots: a row of the pool."""
        if self.pool is None:
            self.pool = ArenaPool(*self.pool_shape, self.dtype, self.device, capacity)
        return self.pool.take(capacity)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part], logits_at: torch.Tensor | None,
            hidden: torch.Tensor | None = None) -> Any:
        """The bucket's outputs for this call (valid until the bucket's next call), or None for a
        call no bucket covers (run it eagerly). tokens, positions: [N]; hidden: [N, H]."""
        n = tokens.shape[0]
        k = n if logits_at is None else logits_at.shape[0]
        rows, count = bucket(max(n, k), ROW_BUCKETS), bucket(len(parts), PART_BUCKETS)
        pool = self.pool
        pool_rows = [] if pool is None else [pool.row_of(p.arena) for p in parts]
        if rows is None or count is None or pool is None or None in pool_rows:
            self.eager += 1
            return None
        if pool.generation != self.generation:  # the pool grew: its storage moved under the graphs
            self.calls.clear()
            self.generation = pool.generation
        width = width_bucket(max(p.visibility.shape[-1] for p in parts), pool.capacity)
        key = (rows, count, width)
        b = self.calls.get(key)
        if b is None:
            features = (self.hidden_size, self.dtype) if self.hidden_size else None
            b = self.calls[key] = Bucketed.empty(rows, count, width, tokens.device, features)
        b.load(tokens, positions, parts, pool_rows, logits_at, hidden)
        self.replays += 1
        if not self.capture:
            return self.step(b, b.gathered(pool, self.dtype, self.fold))
        if b.graph is None:
            if self.mempool is None:  # one memory pool for all: each graph keeps only its outputs alive
                self.mempool = torch.cuda.graph_pool_handle()
            b.graph, b.out, b.capture_s = capture(lambda: self.step(b, b.gathered(pool, self.dtype, self.fold)),
                                                  self.mempool)
        b.graph.replay()
        return b.out

    def summary(self) -> dict:
        """What a launch reports: graphs captured, their capture time, calls replayed and run eagerly."""
        captured = [b for b in self.calls.values() if b.graph is not None]
        return {"captured": len(captured), "capture_s": round(sum(b.capture_s for b in captured), 3),
                "buckets": sorted(self.calls), "replayed_calls": self.replays, "eager_calls": self.eager,
                "pool": None if self.pool is None else {"rows": self.pool.rows, "capacity": self.pool.capacity}}


def capture(fn: Callable[[], Any], mempool: Any, warmup: int = 2) -> tuple[Any, Any, float]:
    """``fn`` captured as a CUDA graph, after ``warmup`` runs on a side stream (which allocate
    what it needs, outside the graph); returns the graph, its outputs and the seconds it took.
    The warm-up runs do the call for real: its KV writes are the ones a replay repeats."""
    start = time.perf_counter()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out, time.perf_counter() - start


class CudaGraphs:
    """The target's decode and verification calls (``Target.packed``, one-row ``Target.forward``)
    replayed from bucketed graphs; every other call on ``eager``."""

    name = "cuda_graphs"

    def __init__(self, target: Target, eager: Eager, capture: bool = True, why: str = "") -> None:
        self.target, self.eager, self.capture, self.why = target, eager, capture, why
        c = target.config

        def step(b: Bucketed, kv: Gathered) -> Forward:
            return target.run(b.tokens[None], b.positions[None], kv, b.logits_at[None], eager.product)

        self.runner = Runner((c.num_layers, c.num_kv_heads, c.head_dim), target.dtype, target.device, capture, step,
                             fold=eager.fold)

    def new_arena(self, rows: int, capacity: int) -> KVArena:
        return self.runner.arena(capacity) if rows == 1 else self.eager.new_arena(rows, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                write_slots: torch.Tensor, arena: KVArena, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, spans: list[tuple[int, int]] | None = None) -> Forward:
        if tokens.shape[0] == 1 and rows is None and spans is None:  # one row: a packed call of one part
            part = Part(arena, 0, write_slots[0], visibility[0])
            out = self._replay(tokens[0], positions[0], [part], None if logits_at is None else logits_at[0])
            if out is not None:
                return out
        return self.eager.forward(tokens, positions, visibility, write_slots, arena, rows, logits_at, spans)

    def packed(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
               logits_at: torch.Tensor | None = None) -> Forward:
        out = self._replay(tokens, positions, parts, logits_at)
        return out if out is not None else self.eager.packed(tokens, positions, parts, logits_at)

    def _replay(self, tokens: torch.Tensor, positions: torch.Tensor, parts: list[Part],
                logits_at: torch.Tensor | None) -> Forward | None:
        """The call from its bucket's graph, or None (run it eagerly)."""
        out = self.runner.run(tokens, positions, parts, logits_at)
        if out is None:
            return None
        n, k = tokens.shape[0], tokens.shape[0] if logits_at is None else logits_at.shape[0]
        # the next replay overwrites a graph's outputs: the caller gets copies of the real rows
        return Forward(logits=out.logits[:, :k].clone(), aux=out.aux[:, :n].clone(), final=out.final[:, :k].clone())

    def draft_steps(self, head: Eagle3Head) -> DraftSteps:
        """The head's draft steps graphed as the target's calls are."""
        return HeadGraphs(head, self.capture)

    def head_product(self, head: Eagle3Head) -> Product:
        return plain  # steps the graphs do not cover run eagerly, on nn.Linear's own products

    def key(self) -> str:
        return "graphs" if self.capture else "graphs-eager"

    def summary(self) -> dict:
        return {"backend": self.name, "why": self.why, **self.runner.summary()}


class HeadGraphs(Runner):
    """An EAGLE-3 head's draft steps (``Eagle3Head.decode_step``)."""

    def __init__(self, head: Eagle3Head, capture: bool) -> None:
        c, w = head.config, head.fc.weight

        def step(b: Bucketed, kv: Gathered) -> torch.Tensor:
            return head.attend_step(b.tokens[None], b.hidden[None], b.positions[None],
                                    lambda q, k, v: kv.attend(0, q, k, v))

        super().__init__((1, c.num_key_value_heads, c.head_dim), w.dtype, w.device, capture, step, c.hidden_size)

    def decode_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    visibility: torch.Tensor, write_slots: torch.Tensor, arena: KVArena) -> torch.Tensor | None:
        """``Eagle3Head.decode_step`` (batch of one) from the bucket's graph, or None (run it eagerly)."""
        if input_ids.shape[0] != 1:
            return None
        part = Part(arena, 0, write_slots[0], visibility[0])
        out = self.run(input_ids[0], positions[0], [part], None, hidden[0])
        return None if out is None else out[:, :input_ids.shape[1]].clone()


def build(target: Target, eager: Eager, capture: bool = True, why: str = "") -> CudaGraphs:
    """The graphs backend over ``eager`` (``capture``: CUDA graphs; False runs the same padded
    calls eagerly, as a CPU's tests do). A batch-invariant target runs kernels graphs do not capture."""
    if capture and target.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA target; this one is on {target.device.type}")
    return CudaGraphs(target, eager, capture, why)
