"""ToolSpec's memory: the outputs of requests decoded earlier in this launch, keyed by a
summary vector of their prompts, and the most similar ones for a new request (cosine).
A request never retrieves an earlier decode of itself."""

from __future__ import annotations

import torch


class RetrievalStore:
    """Outputs of requests decoded so far, keyed by their request summaries."""

    def __init__(self, k: int = 3) -> None:
        self.k = k
        self.ids: list[str] = []
        self.keys: list[torch.Tensor] = []
        self.outputs: list[list[int]] = []

    def add(self, request_id: str, summary: torch.Tensor, output: list[int]) -> None:
        if request_id in self.ids:  # decoded again (warm-up, repeats): keep the first
            return
        self.ids.append(request_id)
        self.keys.append(torch.nn.functional.normalize(summary.float().cpu(), dim=0))
        self.outputs.append(list(output))

    def nearest(self, summary: torch.Tensor, exclude: str) -> list[list[int]]:
        """The ``k`` most similar earlier outputs, most similar first; never ``exclude``'s."""
        if not self.keys:
            return []
        sims = torch.stack(self.keys) @ torch.nn.functional.normalize(summary.float().cpu(), dim=0)
        order = sims.argsort(descending=True).tolist()
        return [self.outputs[i] for i in order if self.ids[i] != exclude][: self.k]
