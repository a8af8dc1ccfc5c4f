"""What the frozen target tells the EAGLE-3 head about each training token, computed per
batch with ``transformers`` when no feature cache is used (``train.head.feature_cache``).

Per position: the three auxiliary hidden states (HF ``hidden_states[i]``, the *input* of
layer i, for the model config's layer ids), its final normed hidden state (from which
logits over the draft vocabulary are recomputed cheaply), and its full-vocabulary argmax
(positions whose argmax falls outside the draft vocabulary carry no loss). The cached
path stores the same three in ``schemafill.runtime.feature_cache``.
"""

from __future__ import annotations

from typing import Any

import torch

from schemafill.runtime.feature_cache import Features


@torch.no_grad()
def target_features(target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    aux_layer_ids: list[int]) -> Features:
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hs = out.hidden_states  # L+1 entries: hs[i] is the input of layer i, hs[L] the normed output
    aux = torch.cat([hs[i] for i in aux_layer_ids], dim=-1)
    final = out.last_hidden_state
    argmax = target.lm_head(final).argmax(-1)
    return Features(aux=aux, final=final, argmax=argmax)
