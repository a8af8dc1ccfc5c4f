"""The EAGLE-3 training-time-test loss (pure: torch only).

Step k of the head at position t predicts token x[t+2+k]; its soft label is the target's
distribution at position t+1+k restricted to the draft vocabulary and renormalised. A
position carries loss only when that token is a response token (``loss_mask``) and the
target's own greedy choice there exists in the draft vocabulary (else the head could never
be right and the renormalised label would be meaningless). Loss = Σ_k decay^k · L_k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, weighted over steps
    step_loss: list[float]  # mean loss per step
    step_correct: list[int]  # top-1 agreements with the target per step
    step_count: list[int]  # positions with loss per step


def ttt_loss(step_outputs: list[torch.Tensor], logits_fn: Callable[[torch.Tensor], torch.Tensor],
             target_final: torch.Tensor, target_logits_fn: Callable[[torch.Tensor], torch.Tensor],
             target_argmax: torch.Tensor, loss_mask: torch.Tensor, t2d: torch.Tensor, draft_to_target: torch.Tensor,
             decay: float) -> TTTResult:
    """step_outputs[k]: [B, T, D] the head's step-k outputs; logits_fn maps [N, D] -> [N, Vd];
    target_final: [B, T, Ht] the target's final hidden states, mapped by target_logits_fn
    [N, Ht] -> [N, Vd] to its logits at the draft ids (both LM heads run only at positions
    with loss: most tokens are prompt); target_argmax: [B, T] target ids; loss_mask: [B, T]
    1 on response tokens; t2d: [V] bool; draft_to_target: [Vd] target id of each draft id."""
    t = target_final.shape[1]
    # zero but attached to the graph: a batch without loss positions still backpropagates
    # (distributed ranks must all call backward) and simply contributes nothing
    total = step_outputs[0].sum() * 0.0
    step_loss, step_correct, step_count = [], [], []
    for k, outputs in enumerate(step_outputs):
        n = t - 2 - k  # positions t whose predicted token x[t+2+k] lies inside the sequence
        if n <= 0:
            step_loss.append(0.0)
            step_correct.append(0)
            step_count.append(0)
            continue
        head = outputs[:, :n]  # [B, n, D]
        label = target_final[:, 1 + k:1 + k + n]  # [B, n, Ht]
        greedy = target_argmax[:, 1 + k:1 + k + n]  # [B, n]
        mask = loss_mask[:, 2 + k:2 + k + n].bool() & t2d[greedy]  # [B, n]
        count = int(mask.sum())
        if count == 0:
            step_loss.append(0.0)
            step_correct.append(0)
            step_count.append(0)
            continue
        soft = F.softmax(target_logits_fn(label[mask]).float(), dim=-1)  # [N, Vd]
        logits = logits_fn(head[mask])  # [N, Vd]
        logp = F.log_softmax(logits.float(), dim=-1)
        loss_k = -(soft * logp).sum(-1).mean()
        total = total + decay ** k * loss_k
        predicted = draft_to_target[logits.argmax(-1)]
        step_loss.append(loss_k.item())
        step_correct.append(int((predicted == greedy[mask]).sum()))
        step_count.append(count)
    return TTTResult(total, step_loss, step_correct, step_count)
