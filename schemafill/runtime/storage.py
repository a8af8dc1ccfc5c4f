"""Where keys and values live: ``KVArena``, one preallocated tensor per layer for a batch of
sequences; ``ArenaPool``, one such tensor per layer whose rows are handed out as one-row
arenas (what a CUDA graph reads through a row index instead of an address); and
``ArenaStock``, ended requests' one-row arenas kept for the next ones.

An arena stores and serves slots; who owns which slot (prompt, committed response, SIDE
branch, scratch) is the decoder's business (``infer/rounds/arena.py``). Nothing here knows
which backend reads it.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

MIN_WIDTH = 256  # the smallest width bucket; widths and a pool's capacity are powers of two from here


def width_bucket(n: int, capacity: int | None = None) -> int:
    """The power of two ≥ ``n`` (at least ``MIN_WIDTH``), at most ``capacity`` when given."""
    width = max(MIN_WIDTH, 1 << max(n - 1, 0).bit_length())
    return width if capacity is None else min(width, capacity)


def zeroed(count: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    """``count`` zeros [count], and on a CPU the anonymous mapping that holds them: its pages
    take memory only once written. A request's arena reserves room for its longest answer,
    its tree and every SIDE branch, and writes a third of it in a usual answer; zeroed up
    front, every page of it faults in at once (tens of milliseconds a request under load, far
    more on a host whose own memory is lent lazily, as a VM's is)."""
    if device.type != "cpu":
        return torch.zeros(count, dtype=dtype, device=device), None
    memory = mmap.mmap(-1, max(count, 1) * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # MADV_DONTNEED zeroes it
    return torch.frombuffer(memory, dtype=dtype, count=count), memory


class KVArena:
    """Preallocated keys and values: per layer ``[rows, kv_heads, capacity, head_dim]``.

    A row is one independent sequence (a request); slots are positions in the arena, not
    token positions. ``pool_row`` is the row of the ``ArenaPool`` it is a view of, if any;
    ``memory`` the mapping its tensors are views of, if it has one (``zeroed``).
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        n = rows * kv_heads * capacity * head_dim
        flat, self.memory = zeroed(2 * layers * n, dtype, device)  # per layer its keys, then its values
        self.k = [flat[2 * i * n:(2 * i + 1) * n].view(shape) for i in range(layers)]
        self.v = [flat[(2 * i + 1) * n:(2 * i + 2) * n].view(shape) for i in range(layers)]
        self.rows, self.capacity = rows, capacity
        self.pool_row: int | None = None
        self.returns: weakref.finalize | None = None  # back to the ``ArenaStock`` that handed it out
        self._addresses: torch.Tensor | None = None

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor], pool_row: int | None = None,
             memory: mmap.mmap | None = None) -> "KVArena":
        """An arena over per-layer tensors someone else owns (a pool's rows), or that are views
        of ``memory`` (a kept arena's)."""
        arena = cls.__new__(cls)
        arena.k, arena.v = k, v
        arena.rows, arena.capacity = k[0].shape[0], k[0].shape[2]
        arena.pool_row = pool_row
        arena.memory = memory
        arena.returns = None
        arena._addresses = None
        return arena

    def repoint(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Serve the same slots from new storage (a pool that grew has copied them there)."""
        self.k[:], self.v[:] = k, v
        self.capacity, self._addresses = k[0].shape[2], None

    def addresses(self) -> torch.Tensor:
        """[layers, 2, rows] int64: where each layer's keys, then values, of each row start (the
        batch-invariant kernels' view of the arena; its tensors never move, so computed once)."""
        if self._addresses is None:
            step = self.k[0].stride(0) * self.k[0].element_size()
            self._addresses = torch.tensor([[[t.data_ptr() + r * step for r in range(self.rows)] for t in (k, v)]
                                            for k, v in zip(self.k, self.v)], dtype=torch.int64)
        return self._addresses

    def write(self, layer: int, rows: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B, T]; k, v: [B, Hkv, T, hd]
        if rows is None and slots.shape[0] == 1:  # one arena row: a copy along slots, no index grid
            self.k[layer][0].index_copy_(1, slots[0], k[0])
            self.v[layer][0].index_copy_(1, slots[0], v[0])
            return
        r = torch.arange(slots.shape[0], device=slots.device) if rows is None else rows
        self.k[layer][r[:, None], :, slots] = k.transpose(1, 2)
        self.v[layer][r[:, None], :, slots] = v.transpose(1, 2)

    def prefix(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of row 0's first ``n`` slots: per layer keys and values [kv_heads, n, head_dim]."""
        return [k[0, :, :n].clone() for k in self.k], [v[0, :, :n].clone() for v in self.v]

    def load_prefix(self, k: list[torch.Tensor], v: list[torch.Tensor], n: int) -> None:
        """Row 0's first ``n`` slots take the first ``n`` of ``prefix``'s copies."""
        for mine, theirs in zip(self.k + self.v, k + v):
            mine[0, :, :n] = theirs[:, :n]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row ``dst`` takes row ``src``'s first ``n`` slots (a shared prompt prefix)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots ``src`` of ``row`` are copied to ``dst`` (accepted scratch rows joining a
        committed region); the source is gathered first, so overlapping moves are safe."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        device = self.k[0].device
        s = torch.tensor([p[0] for p in pairs], device=device)
        d = torch.tensor([p[1] for p in pairs], device=device)
        for k, v in zip(self.k, self.v):
            k[row, :, d] = k[row, :, s]
            v[row, :, d] = v[row, :, s]

    def read(self, layer: int, rows: torch.Tensor | None, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``span`` slots of the given rows: a view when all rows are read."""
        k, v = self.k[layer][:, :, :span], self.v[layer][:, :, :span]
        if rows is None:
            return k, v
        return k[rows], v[rows]


class ArenaStock:
    """One-row arenas of requests that have ended, kept for the next ones. A fresh arena of
    tens of megabytes costs the host page faults as it is written (serial with a batch's
    rounds); a kept one is zeroed again — its mapping's pages dropped (``zeroed``), else a
    memset — and faults in only the pages its next request writes. ``take`` hands out a kept
    arena of at least the capacity asked and at most twice it, or a new one with room to the
    next multiple of ``grain`` slots (so that it fits the next prompts too); either comes back when its
    owner ``give``s it back (a request that ended) or when it is collected, and at most ``keep``
    wait here. Thread-safe: a server's arenas may be collected on any thread."""

    def __init__(self, keep: int = 32, grain: int = 512) -> None:
        self.keep, self.grain = keep, grain
        self.free: list[tuple[list[torch.Tensor], list[torch.Tensor], mmap.mmap | None]] = []
        self._lock = threading.Lock()

    def take(self, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> KVArena:
        inference = torch.is_inference_mode_enabled()  # an arena made in inference mode is written only in it

        def fits(k: list[torch.Tensor]) -> bool:
            _, heads, width, dim = k[0].shape
            return (len(k), heads, dim, k[0].dtype, k[0].device) == (layers, kv_heads, head_dim, dtype, device) \
                and capacity <= width <= 2 * capacity and (inference or not k[0].is_inference())

        with self._lock:
            i = next((i for i, (k, _, _) in enumerate(self.free) if fits(k)), None)
            kept = None if i is None else self.free.pop(i)
        if kept is None:  # room to the next multiple of ``grain``: later requests' prompts differ in length
            width = -(-capacity // self.grain) * self.grain
            arena = KVArena(layers, 1, kv_heads, width, head_dim, dtype, device)
        else:  # zeroed: what a fresh arena holds, a slot no request wrote reads as zeros
            k, v, memory = kept
            if memory is not None:
                memory.madvise(mmap.MADV_DONTNEED)  # a private anonymous mapping's pages read as zeros again
            else:
                for t in k + v:
                    t.zero_()
            arena = KVArena.over(k, v, memory=memory)
        arena.returns = weakref.finalize(arena, self._put, arena.k, arena.v, arena.memory)
        return arena

    def give(self, arena: KVArena) -> None:
        """``arena`` back from an owner done with it, before it is collected (a request's
        sessions and drafters may be collected much later). Its slots are the next request's:
        it is left empty, so a late read fails instead of reading another request's KV. An
        arena this stock did not hand out is left alone."""
        if arena.returns is not None and arena.returns.detach() is not None:
            k, v, memory = arena.k, arena.v, arena.memory
            arena.k, arena.v, arena.memory = [], [], None
            self._put(k, v, memory)

    def _put(self, k: list[torch.Tensor], v: list[torch.Tensor], memory: mmap.mmap | None) -> None:
        with self._lock:
            if len(self.free) < self.keep:
                self.free.append((k, v, memory))


class ArenaPool:
    """The KV of many one-row arenas: per layer ``[rows, kv_heads, capacity, head_dim]``, row 0
    a scratch row never handed out. ``take`` hands out a row as a ``KVArena`` over views of
    it; the row returns to the pool when that arena is collected. When the rows or the
    capacity run out the pool grows (doubling), copies what it holds and repoints every live
    arena at its new storage; ``generation`` counts growths, so whoever captured the old
    storage's addresses knows to let them go."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int, rows: int = 1) -> None:
        self._shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows, self.capacity, self.generation = 0, 0, 0
        self.free: list[int] = []
        self.live: dict[int, weakref.ref] = {}
        self._allocate(rows + 1, width_bucket(capacity))

    def take(self, capacity: int) -> KVArena:
        if capacity > self.capacity:
            self._allocate(self.rows, width_bucket(capacity))
        if not self.free:
            self._allocate(2 * self.rows - 1, self.capacity)
        row = self.free.pop()
        arena = KVArena.over([k[row:row + 1] for k in self.k], [v[row:row + 1] for v in self.v], pool_row=row)
        self.live[row] = weakref.ref(arena)
        weakref.finalize(arena, self._release, row)
        return arena

    def row_of(self, arena: KVArena) -> int | None:
        """The pool row ``arena`` is, or None for an arena the pool did not hand out."""
        row = arena.pool_row
        return row if row is not None and row in self.live and self.live[row]() is arena else None

    def _release(self, row: int) -> None:
        self.live.pop(row, None)
        self.free.append(row)

    def _allocate(self, rows: int, capacity: int) -> None:
        layers, heads, hd = self._shape
        old_rows, old_capacity = self.rows, self.capacity
        k = [torch.zeros(rows, heads, capacity, hd, dtype=self.dtype, device=self.device) for _ in range(layers)]
        v = [torch.zeros(rows, heads, capacity, hd, dtype=self.dtype, device=self.device) for _ in range(layers)]
        for new, old in zip(k + v, self.k + self.v):
            new[:old_rows, :, :old_capacity] = old
        self.k, self.v, self.rows, self.capacity = k, v, rows, capacity
        self.free = sorted(set(self.free) | set(range(max(old_rows, 1), rows)), reverse=True)
        for row, ref in list(self.live.items()):  # a collection may release a row meanwhile
            arena = ref()
            if arena is not None:
                arena.repoint([t[row:row + 1] for t in k], [t[row:row + 1] for t in v])
        self.generation += 1
