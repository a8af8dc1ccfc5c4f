"""A candidate draft tree whose nodes know who proposed them.

Pure (standard library and ``infer/rounds/tree.py``). ``Candidates`` is a draft tree
(tokens, parents; ``infer/rounds/tree.py``'s conventions) plus one source tag per node, the
key under which ``infer/pricing/acceptance.py`` learns how often such nodes are accepted.
Proposals from several drafters merge into one prefix tree; a node two of them proposed
keeps the source whose acceptance estimate is higher, so the selection sees the best
evidence for it and the statistics credit the source that would have been trusted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from infer.rounds.tree import ROOT, depths, merge_indexed, prune


def chain_source(kind: str, depth: int) -> str:
    """A chain's node at ``depth`` (1 = first) of a proposal of ``kind``: depths 1-4 each on
    their own, then 5-8, 9-16 and 17 on pooled (tagged 8, 16, 32). A copy that has held for
    many tokens tends to hold for the next one (a response in a loop), so deep nodes are not
    pooled with the fourth: pooled at 4, a 32-token copy's last node was valued at 0.88^28."""
    return f"{kind}:{depth if depth <= 4 else min(1 << (depth - 1).bit_length(), 32)}"


@dataclass
class Candidates:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.sources):
            raise ValueError(f"{len(self.tokens)} tokens, {len(self.parents)} parents and {len(self.sources)} "
                             f"sources: a candidate tree needs one of each per node")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], kind: str) -> "Candidates":
        """A single path proposed by ``kind``, each node tagged with its depth in it."""
        return cls.tagged_chain(tokens, [kind] * len(tokens))

    @classmethod
    def tagged_chain(cls, tokens: list[int], kinds: list[str]) -> "Candidates":
        """A single path whose nodes have their own kinds (the packer's bridges and values),
        each tagged with its depth in the run of its kind."""
        sources, run = [], 0
        for i, kind in enumerate(kinds):
            run = run + 1 if i and kinds[i - 1] == kind else 1
            sources.append(chain_source(kind, run))
        return cls(list(tokens), [i - 1 if i else ROOT for i in range(len(tokens))], sources)

    @classmethod
    def tree(cls, tokens: list[int], parents: list[int], kind: str) -> "Candidates":
        """A tree proposed by ``kind``, each node tagged with its depth."""
        return cls(list(tokens), list(parents), [chain_source(kind, d) for d in depths(parents)])

    @classmethod
    def merged(cls, parts: list["Candidates"], rate: Callable[[str], float]) -> "Candidates":
        """One prefix tree over ``parts``; shared nodes keep their highest-rated source."""
        tokens, parents, maps = merge_indexed([(c.tokens, c.parents) for c in parts])
        sources: list[str | None] = [None] * len(tokens)
        for part, mapped in zip(parts, maps):
            for s, j in zip(part.sources, mapped):
                if sources[j] is None or rate(s) > rate(sources[j]):
                    sources[j] = s
        return cls(tokens, parents, sources)

    def subset(self, keep: list[int]) -> "Candidates":
        """The nodes ``keep`` (closed under ancestors), renumbered."""
        flags = [False] * len(self.tokens)
        for i in keep:
            flags[i] = True
        index, parents = prune(self.parents, flags)
        return Candidates([self.tokens[i] for i in index], parents, [self.sources[i] for i in index])
