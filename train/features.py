"""What the frozen target tells the EAGLE-3 head about each training token.

For a batch of continuation rows the target (under no-grad) yields, per position: the
three auxiliary hidden states (HF ``hidden_states[i]``, the *input* of layer i, for the
model config's layer ids), its final normed hidden state (from which logits over the draft
vocabulary are recomputed cheaply), and its full-vocabulary argmax (positions whose argmax
falls outside the draft vocabulary carry no loss).

``FeatureCache`` stores them once on disk (fp16 memory maps) so several head epochs on a
CPU read features instead of rerunning the target; ``online`` computes them per batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from schemafill import atomic


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
    def build(folder: str | Path, target: Any, rows: list[list[int]], aux_layer_ids: list[int],
              batch_tokens: int = 8192) -> "FeatureCache":
        """Run the target once over ``rows`` (token id lists) and store its features."""
        folder = Path(folder)
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + len(r))
        device = next(target.parameters()).device
        hidden = target.config.hidden_size
        with atomic.atomic_path(folder) as tmp:
            tmp.mkdir()
            aux = np.memmap(tmp / "aux.f16", dtype=np.float16, mode="w+", shape=(offsets[-1], 3 * hidden))
            final = np.memmap(tmp / "final.f16", dtype=np.float16, mode="w+", shape=(offsets[-1], hidden))
            argmax = np.memmap(tmp / "argmax.i32", dtype=np.int32, mode="w+", shape=(offsets[-1],))
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
            bar = tqdm(total=offsets[-1], desc="target features", unit="tok", unit_scale=True, dynamic_ncols=True)
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and len(rows[order[end]]) * (end - start + 1) <= batch_tokens:
                    end += 1
                idx = order[start:end]
                width = max(len(rows[i]) for i in idx)
                ids = torch.zeros(len(idx), width, dtype=torch.long)
                mask = torch.zeros(len(idx), width, dtype=torch.long)
                for b, i in enumerate(idx):
                    ids[b, : len(rows[i])] = torch.tensor(rows[i])
                    mask[b, : len(rows[i])] = 1
                f = target_features(target, ids.to(device), mask.to(device), aux_layer_ids)
                for b, i in enumerate(idx):
                    n, o = len(rows[i]), offsets[i]
                    aux[o:o + n] = f.aux[b, :n].float().cpu().numpy().astype(np.float16)
                    final[o:o + n] = f.final[b, :n].float().cpu().numpy().astype(np.float16)
                    argmax[o:o + n] = f.argmax[b, :n].cpu().numpy()
                bar.update(int(mask.sum()))
                start = end
            bar.close()
            for m in (aux, final, argmax):
                m.flush()
            (tmp / "meta.json").write_text(json.dumps({"offsets": offsets, "tokens": offsets[-1],
                                                       "aux_dim": 3 * hidden, "hidden": hidden}))
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
