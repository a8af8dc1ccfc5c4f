"""How the target picks its token at each verified node: greedy, or an exact sample.

Every proposal we verify is deterministic given the state before the decision (the
head's top-k tree, structural bridges, prepared SIDE values; the paper's drafters stay at
temperature 0), so its proposal distribution q is a point mass. For a point mass, the
speculative-sampling rule of Leviathan et al. (paper App. B, Eq. 6–7) — accept v with
probability min(1, p(v)/q(v)) = p(v), on rejection sample the residual p with v removed —
is the same as drawing w ~ p and accepting v iff w = v, the correction being w itself.
With several candidate children of one node the same holds, applied to each in turn:
drawing w ~ p once and descending into the child equal to w (committing w when none is)
emits every token with exactly p's probability. So the tree rule is ``greedy_accept``
with each node's *choice* being an independent draw from p at that node instead of its
argmax: every committed token is a fresh sample from the target at its own prefix, which
is serial sampling. The draws use their own generator, independent of any proposal.

Pure: torch only.
"""

from __future__ import annotations

import torch


class Sampler:
    """Turns target logits into one choice per node: argmax at temperature 0, else a draw
    from softmax(logits / temperature), optionally restricted to the top-p nucleus."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits -> [N, V] the distribution each node samples from (fp32)."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_p, order = p.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # the smallest prefix reaching top_p
            p = torch.zeros_like(p).scatter(-1, order, sorted_p * keep)
            p = p / p.sum(-1, keepdim=True)
        return p

    def choose(self, logits: torch.Tensor) -> list[int]:
        """[N, V] logits -> one token per node; draws are independent across nodes and calls."""
        if self.greedy:
            return logits.argmax(-1).tolist()
        p = self.probs(logits).cpu()
        return torch.multinomial(p, 1, generator=self.generator)[:, 0].tolist()
