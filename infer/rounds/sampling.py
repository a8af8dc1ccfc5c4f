"""How the target picks its token at each verified node: greedy, or an exact sample, under
every sampling parameter a client may ask for.

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

*Its own prefix* is the whole point for the parameters that read the text so far
(``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``): a node deep in a
draft tree is decided after the committed response *and the drafted path above it*, so
its penalties count that path's tokens too (vLLM once applied them to the committed
tokens only under speculation, and its outputs drifted from plain sampling's). ``p`` at
a node is therefore: the target's logits, plus ``logit_bias``, penalised by that node's
history, (then the grammar's mask, ``verify.choose``), and at temperature > 0 scaled by
the temperature and cut by ``top_k``, ``top_p`` and ``min_p``. At temperature 0 the
choice is the argmax of the biased, penalised logits: what greedy AR with those
parameters picks. The order is vLLM's.

Pure: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of each choice (OpenAI's fields, and vLLM's ``top_k``, ``min_p``,
    ``repetition_penalty``)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # the smallest set of most likely tokens reaching this mass
    top_k: int = 0  # only the k most likely tokens (0: all)
    min_p: float = 0.0  # only tokens at least this fraction of the most likely one's probability
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the response
    presence_penalty: float = 0.0  # subtracted once for any earlier occurrence in the response
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens in prompt or response
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit)

    def __post_init__(self) -> None:
        checks = {"temperature >= 0": self.temperature >= 0, "0 < top_p <= 1": 0 < self.top_p <= 1,
                  "top_k >= 0": self.top_k >= 0, "0 <= min_p <= 1": 0 <= self.min_p <= 1,
                  "repetition_penalty > 0": self.repetition_penalty > 0}
        wrong = [rule for rule, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(f"sampling parameters break {wrong}: {self}")

    @property
    def reads_history(self) -> bool:
        """Does a node's choice depend on the tokens before it (not only its logits)?"""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)

    @property
    def shapes_logits(self) -> bool:
        """Does the choice differ from the raw logits' even at temperature 0?"""
        return self.reads_history or bool(self.logit_bias)


@dataclass(frozen=True)
class History:
    """The tokens before each node of one call: the prompt, the committed response (up to
    and including the tree's root), and each node's drafted path after it ([] at the root)."""

    prompt: list[int]
    response: list[int]
    paths: list[list[int]]  # one per row of the logits being chosen from


def tree_paths(tree_tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The drafted tokens on the way to the root (first) and to every node of a tree,
    root-most first; ``parents`` index earlier nodes, negative for the root."""
    paths: list[list[int]] = [[]]
    for tok, parent in zip(tree_tokens, parents):
        paths.append((paths[1 + parent] if parent >= 0 else []) + [tok])
    return paths


class Sampler:
    """What a request's choices need beside the logits: its ``SamplingParams``, the bias and
    penalties (``adjust``), the distribution a draw is from (``probs``) and the draws'
    own generator (``draw``); ``verify.choose`` makes the choice, grammar included."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, **more) -> None:
        """``more``: the other ``SamplingParams`` fields."""
        self.params = SamplingParams(temperature, top_p, **more)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy on the raw logits: the argmax the target's own read-back gives."""
        return self.greedy and not self.params.shapes_logits

    def adjust(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """[N, V] logits -> [N, V] (fp32) with the bias added and the penalties of each row's
        history applied. ``history`` may be None only where no penalty is asked for."""
        s = self.params
        if not s.shapes_logits:
            return logits
        out = logits.float().clone()
        if s.logit_bias:
            ids = torch.tensor([t for t, _ in s.logit_bias], device=out.device)
            out[:, ids] += torch.tensor([b for _, b in s.logit_bias], device=out.device)
        if not s.reads_history:
            return out
        if history is None or len(history.paths) != out.shape[0]:
            raise ValueError("penalties need the history of every row")
        counts = self._counts(history, out.shape[-1]).to(out.device)  # [N, V]
        if s.repetition_penalty != 1:
            seen = counts > 0
            if history.prompt:
                seen[:, torch.tensor(history.prompt, device=out.device)] = True
            scaled = torch.where(out > 0, out / s.repetition_penalty, out * s.repetition_penalty)
            out = torch.where(seen, scaled, out)
        out = out - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
        return out

    @staticmethod
    def _counts(history: History, vocab: int) -> torch.Tensor:
        """[N, V] how often each token occurs in each row's response so far."""
        base = torch.bincount(torch.tensor(history.response, dtype=torch.long), minlength=vocab).float()
        counts = base.expand(len(history.paths), vocab).clone()
        for row, path in enumerate(history.paths):
            for tok in path:
                counts[row, tok] += 1
        return counts

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] (adjusted) logits -> [N, V] the distribution each node samples from (fp32)."""
        s = self.params
        logits = logits.float() / s.temperature
        if s.top_k and s.top_k < logits.shape[-1]:
            kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        if s.top_p < 1:
            sorted_p, order = p.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < s.top_p  # the smallest prefix reaching top_p
            p = torch.zeros_like(p).scatter(-1, order, sorted_p * keep)
        if s.min_p > 0:
            p = p * (p >= s.min_p * p.max(-1, keepdim=True).values)
        return p / p.sum(-1, keepdim=True)

    def draw(self, logits: torch.Tensor) -> list[int]:
        """[N, V] adjusted (and masked) logits -> one independent draw per row."""
        p = self.probs(logits).cpu()
        return torch.multinomial(p, 1, generator=self.generator)[:, 0].tolist()
