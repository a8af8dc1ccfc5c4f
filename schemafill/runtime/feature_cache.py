"""The on-disk store of what the frozen target tells the EAGLE-3 head about each token.

Per token of every row: the three auxiliary hidden states (HF ``hidden_states[i]``, the
*input* of layer i), the final normed hidden state (logits over the draft vocabulary are
recomputed from it cheaply) and the full-vocabulary argmax; ``final`` and ``argmax`` only
from each row's ``start`` on (the position before its first response token: all the loss
reads), zero before it. Flat fp16/int32 memory maps plus row offsets, so head epochs on a
CPU read features instead of rerunning the target.

Two writers fill the same format: ``FeatureCache.build`` runs the runtime target over
finished rows (resumable), and ``FeatureCache.write`` stores features a caller already
has — the ones the continuations stage captures while it generates the very tokens.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from schemafill import atomic
from schemafill.runtime.calls import causal_visibility
from schemafill.runtime.generation import common_prefix
from schemafill.runtime.model import Target

FEATURES = "features"  # where a continuations folder keeps the features it captured


@dataclass
class Features:
    aux: torch.Tensor  # [B, T, 3*Ht]
    final: torch.Tensor  # [B, T, Ht] target's last hidden state after its final norm
    argmax: torch.Tensor  # [B, T] target's greedy next token at each position


@dataclass
class RowFeatures:
    """One row's features as a generator captured them (fp16/int64, on the CPU)."""

    aux: torch.Tensor  # [L', 3*Ht] positions 0..L'-1 (L' may stop short of the row: the rest is zero)
    final: torch.Tensor  # [F, Ht] positions start..start+F-1
    argmax: torch.Tensor  # [F] the same positions
    start: int


def _maps(folder: Path, meta: dict, mode: str) -> tuple[np.memmap, np.memmap, np.memmap]:
    n, a, h = meta["tokens"], meta["aux_dim"], meta["hidden"]
    return (np.memmap(folder / "aux.f16", dtype=np.float16, mode=mode, shape=(n, a)),
            np.memmap(folder / "final.f16", dtype=np.float16, mode=mode, shape=(n, h)),
            np.memmap(folder / "argmax.i32", dtype=np.int32, mode=mode, shape=(n,)))


def _meta(lengths: Iterable[int], aux_dim: int, hidden: int, source: dict | None) -> dict:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return {"offsets": offsets, "tokens": offsets[-1], "aux_dim": aux_dim, "hidden": hidden, "source": source or {}}


class FeatureCache:
    """Features of every token of a dataset, in flat fp16/int32 memory maps plus offsets."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.offsets = self.meta["offsets"]
        self.aux, self.final, self.argmax = _maps(self.folder, self.meta, "r")

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / "meta.json").is_file()

    @staticmethod
    def write(folder: str | Path, lengths: list[int], aux_dim: int, hidden: int,
              rows: Iterable[tuple[int, RowFeatures]], source: dict | None = None) -> "FeatureCache":
        """Store features captured elsewhere: ``(row index, RowFeatures)`` pairs, in any order,
        for the rows of ``lengths``; ``source`` (e.g. aux layer ids, dtype) lets a reader
        check they fit it."""
        meta = _meta(lengths, aux_dim, hidden, source)
        with atomic.atomic_path(folder) as tmp:
            tmp.mkdir()
            aux, final, argmax = _maps(tmp, meta, "w+")
            for i, f in rows:
                o, n = meta["offsets"][i], lengths[i]
                a, s, m = min(len(f.aux), n), f.start, min(len(f.final), n - f.start)
                aux[o:o + a] = f.aux[:a].numpy()
                final[o + s:o + s + m] = f.final[:m].numpy()
                argmax[o + s:o + s + m] = f.argmax[:m].numpy()
            for x in (aux, final, argmax):
                x.flush()
            del aux, final, argmax
            atomic.write_json(tmp / "meta.json", meta)
        return FeatureCache(folder)

    @staticmethod
    def build(folder: str | Path, target: Target, rows: list[list[int]], starts: list[int],
              save_every: int = 64, source: dict | None = None) -> "FeatureCache":
        """Run the runtime target once over ``rows`` (token id lists) and store its features.

        Rows run in prefix order and reuse the previous row's KV and features for their
        common prefix, so shared instructions and catalogs are computed once. Interrupted,
        it resumes from its last progress mark (every ``save_every`` rows).
        """
        folder = Path(folder)
        hidden = target.config.hidden_size
        meta = _meta(map(len, rows), len(target.config.aux_layer_ids) * hidden, hidden, source)
        offsets = meta["offsets"]
        work = folder.parent / f".{folder.name}.partial"
        progress = work / "progress.json"
        resumed = progress.is_file() and json.loads((work / "meta.json").read_text()) == meta
        if not resumed:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            atomic.write_json(work / "meta.json", meta)
        aux, final, argmax = _maps(work, meta, "r+" if resumed else "w+")
        done = json.loads(progress.read_text())["rows_done"] if resumed else 0

        order = sorted(range(len(rows)), key=lambda i: rows[i])
        dev = target.device
        arena = target.new_arena(1, max(map(len, rows)))
        bar = tqdm(total=len(rows), initial=done, desc="target features", unit="row", dynamic_ncols=True)
        prev = None  # the previous row in this process: its KV is in the arena
        for k in range(done, len(order)):
            i = order[k]
            row, o = rows[i], offsets[i]
            shared = 0 if prev is None else min(common_prefix(rows[prev], row), len(row) - 1)
            if shared:  # same tokens at the same positions: same features
                po = offsets[prev]
                aux[o:o + shared] = aux[po:po + shared]
                final[o:o + shared] = final[po:po + shared]
                argmax[o:o + shared] = argmax[po:po + shared]
            pos = torch.arange(shared, len(row), device=dev)[None]  # [1, T]
            visible = causal_visibility(pos, len(row))  # [1, T, n]
            first = max(starts[i], shared)  # logits only where the loss will look
            f = target(torch.tensor(row[shared:], device=dev)[None], pos, visible, pos, arena,
                       logits_at=torch.arange(first - shared, len(row) - shared, device=dev)[None])
            aux[o + shared:o + len(row)] = f.aux[0].float().cpu().numpy().astype(np.float16)
            final[o + first:o + len(row)] = f.final[0].float().cpu().numpy().astype(np.float16)
            argmax[o + first:o + len(row)] = f.logits[0].argmax(-1).cpu().numpy()
            prev = i
            bar.update(1)
            if (k + 1) % save_every == 0:
                for m in (aux, final, argmax):
                    m.flush()
                atomic.write_json(progress, {"rows_done": k + 1})
        bar.close()
        for m in (aux, final, argmax):
            m.flush()
        del aux, final, argmax
        progress.unlink(missing_ok=True)
        with atomic.atomic_path(folder) as tmp:
            work.rename(tmp)
        return FeatureCache(folder)

    def batch(self, indices: list[int], width: int) -> Features:
        """Right-padded features of rows ``indices``."""
        b = len(indices)
        aux = torch.zeros(b, width, self.aux.shape[1])
        final = torch.zeros(b, width, self.final.shape[1])
        argmax = torch.zeros(b, width, dtype=torch.long)
        for j, i in enumerate(indices):
            o, e = self.offsets[i], self.offsets[i + 1]
            n = min(e - o, width)
            aux[j, :n] = torch.from_numpy(np.asarray(self.aux[o:o + n], dtype=np.float32))
            final[j, :n] = torch.from_numpy(np.asarray(self.final[o:o + n], dtype=np.float32))
            argmax[j, :n] = torch.from_numpy(np.asarray(self.argmax[o:o + n], dtype=np.int64))
        return Features(aux=aux, final=final, argmax=argmax)
