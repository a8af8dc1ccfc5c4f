"""Suffix-tree drafts (SuffixDecoding, arXiv 2411.04975; Arctic Inference's vLLM plugin): one
tree over this request's prompt and response, one over the responses decoded earlier in the
launch; whichever scores higher drafts, its size adapting to how long the match is and how
often its continuations occurred (``suffix_tree.py``).

Both trees grow token by token as the response is committed (the launch's too, as Arctic
Inference does). The launch's tree (``SuffixMemory``) starts empty in each launch
(``reset`` after warm-up), and a request never matches an earlier decode of itself: that
response is removed before it starts. Requests key the launch's tree by their id, so
requests decoded in any order keep their own sequences apart.
"""

from __future__ import annotations

from infer.proposers.suffix_tree import SuffixTree
from infer.rounds.candidates import Candidates
from infer.rounds.session import MainSession
from schemafill.config import SuffixConfig


class SuffixMemory:
    """The responses a launch has decoded, as one suffix tree (None when the method keeps none)."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        """Forget every earlier response (a launch's measured pass starts here)."""
        self.responses = SuffixTree(self.cfg.max_tree_depth) if self.cfg.max_cached_requests else None

    def admit(self, key: str) -> SuffixTree | None:
        """Room for request ``key``: its earlier decode (warm-up, another sample) and, past the
        cap, the oldest responses go."""
        if self.responses is not None:
            self.responses.remove(key)
            while len(self.responses) >= self.cfg.max_cached_requests:
                self.responses.remove(next(iter(self.responses.sequences)))
        return self.responses


class SuffixProposer:
    """One request's drafts: its own prompt-and-response tree, and the launch's response tree."""

    drafted = False  # no model of its own

    def __init__(self, cfg: SuffixConfig, responses: SuffixTree | None, key: str) -> None:
        self.cfg, self.responses, self.key = cfg, responses, key
        self.local = SuffixTree(cfg.max_tree_depth)
        self.seen = 0  # tokens of prompt + response already in the trees
        self.prompt_len = 0

    def start(self, s: MainSession) -> None:
        self.prompt_len = len(s.prompt)

    def catch_up(self, tokens: list[int]) -> None:
        """Add the tokens committed since the last call to both trees."""
        self.local.extend(0, tokens[self.seen:])
        if self.responses is not None:
            self.responses.extend(self.key, tokens[max(self.seen, self.prompt_len):])
        self.seen = len(tokens)

    def propose(self, s: MainSession) -> Candidates:
        c = self.cfg
        self.catch_up(s.tokens)
        context = s.tokens[-c.max_tree_depth:]
        args = (c.num_speculative_tokens, c.max_spec_factor, c.max_spec_offset, c.min_token_prob, c.tree)
        best = self.local.speculate(context, *args)
        if self.responses is not None:
            other = self.responses.speculate(context, *args)
            if other.score > best.score:  # the prompt's tree wins ties
                best = other
        return Candidates.tree(best.tokens, best.parents, "suffix")

    def finish(self, s: MainSession) -> dict:
        self.catch_up(list(s.prompt) + s.response)  # the last verification's tokens too: later requests read them
        return {}
