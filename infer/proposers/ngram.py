"""Prompt-lookup (n-gram) drafts, as vLLM's ``ngram`` speculative method proposes them: the
tokens that followed the earliest earlier occurrence of the context's longest trailing
n-gram (``lookup.ngram_lookup``), searched in the prompt and the response so far."""

from __future__ import annotations

from dataclasses import dataclass

from infer.proposers.lookup import ngram_lookup
from infer.rounds.candidates import Candidates
from infer.rounds.session import MainSession
from schemafill.config import NgramConfig


@dataclass(frozen=True)
class NgramProposer:
    cfg: NgramConfig
    drafted = False  # no model of its own: lookups cost next to nothing

    def start(self, s: MainSession) -> None:
        pass

    def propose(self, s: MainSession) -> Candidates:
        c = self.cfg
        return Candidates.chain(ngram_lookup(s.tokens, c.prompt_lookup_min, c.prompt_lookup_max,
                                             c.num_speculative_tokens), "ngram")

    def finish(self, s: MainSession) -> dict:
        return {}
