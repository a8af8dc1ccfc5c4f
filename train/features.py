"""What the frozen target tells the EAGLE-3 head about each training token.

For a batch of continuation rows the target (under no-grad) yields, per position: the
three auxiliary hidden states (HF ``hidden_states[i]``, the *input* of layer i, for the
model config's layer ids), its final normed hidden state (from which logits over the draft
vocabulary are recomputed cheaply), and its full-vocabulary argmax (positions whose argmax
falls outside the draft vocabulary carry no loss).

``FeatureCache`` stores them once on disk (fp16 memory maps) so several head epochs on a
CPU read features instead of rerunning the target; it runs the inference runtime with
shared prompt prefixes computed once, and resumes when interrupted. Without the cache,
``target_features`` computes them per batch with ``transformers``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from schemafill import atomic
from schemafill.generate import common_prefix
from schemafill.runtime import Target, causal_visibility


@dataclass
class Features:
    aux: torch.Tensor  # [B, T, 3*Ht]
    final: torch.Tensor  # [B, T, Ht] target's last hidden state after its final norm
    argmax: torch.Tensor  # [B, T] target's greedy next token at each position


@torch.no_grad()
def target_features(target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    aux_layer_ids: list[int]) -> Features:
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hs = out.hidden_states  # L+1 entries: hs[i] is the input of layer i, hs[L] the normed output
    aux = torch.cat([hs[i] for i in aux_layer_ids], dim=-1)
    final = out.last_hidden_state
    argmax = target.lm_head(final).argmax(-1)
    return Features(aux=aux, final=final, argmax=argmax)


class FeatureCache:
    """Features of every token of a dataset, in flat fp16/int32 memory maps plus offsets."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        self.offsets = meta["offsets"]
        n, h3, h = meta["tokens"], meta["aux_dim"], meta["hidden"]
        self.aux = np.memmap(self.folder / "aux.f16", dtype=np.float16, mode="r", shape=(n, h3))
        self.final = np.memmap(self.folder / "final.f16", dtype=np.float16, mode="r", shape=(n, h))
        self.argmax = np.memmap(self.folder / "argmax.i32", dtype=np.int32, mode="r", shape=(n,))

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / "meta.json").is_file()

    @staticmethod
    def build(folder: str | Path, target: Target, rows: list[list[int]], starts: list[int],
              save_every: int = 64) -> "FeatureCache":
        """Run the runtime target once over ``rows`` (token id lists) and store its features.

        ``final`` and ``argmax`` are computed only from ``starts[i]`` on (the position before
        the first response token: all the loss needs); before it they stay zero. Rows run
        in prefix order and reuse the previous row's KV and features for their common
        prefix, so shared instructions and catalogs are computed once. Interrupted, it
        resumes from its last progress mark (every ``save_every`` rows).
        """
        folder = Path(folder)
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + len(r))
        hidden = target.config.hidden_size
        aux_dim = len(target.config.aux_layer_ids) * hidden
        meta = {"offsets": offsets, "tokens": offsets[-1], "aux_dim": aux_dim, "hidden": hidden}
        work = folder.parent / f".{folder.name}.partial"
        progress = work / "progress.json"
        resumed = progress.is_file() and json.loads((work / "meta.json").read_text()) == meta
        if not resumed:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            atomic.write_json(work / "meta.json", meta)
        mode = "r+" if resumed else "w+"
        aux = np.memmap(work / "aux.f16", dtype=np.float16, mode=mode, shape=(offsets[-1], aux_dim))
        final = np.memmap(work / "final.f16", dtype=np.float16, mode=mode, shape=(offsets[-1], hidden))
        argmax = np.memmap(work / "argmax.i32", dtype=np.int32, mode=mode, shape=(offsets[-1],))
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
