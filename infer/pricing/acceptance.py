"""Acceptance estimates per draft source, kept as running statistics during a launch.

Pure (standard library and ``infer/rounds/tree.py``). Every candidate node is tagged with the source that proposed
it: the head at a bucket of its own probability (``head_source``), a packer bridge, a
prepared or provisional value, a prompt-lookup copy, a retrieved or recycled chain, … with
its depth in that proposal. ``AcceptanceStats`` estimates, per source, the chance a node is
accepted *given its parent was* — the quantity ``infer/pricing/selection.py`` multiplies along a path
— as a Beta posterior mean that starts from a fixed prior and learns from every
verification: a node is *reached* when its parent is the root or on the accepted path, and
*accepted* when it is on that path itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.rounds.tree import ROOT

HEAD_BUCKETS = 10
PRIOR_STRENGTH = 4.0  # pseudo-observations behind each prior


def head_source(q: float) -> str:
    """The source tag of a head draft whose own probability (given its parent) is ``q``."""
    return f"head:{min(int(q * HEAD_BUCKETS), HEAD_BUCKETS - 1)}"


# where a source starts before it has been observed (the statistics take over after a few
# rounds): the packer's structure is nearly always what the target writes, its values less so
PRIORS = {"pack_bridge": 0.9, "side_bridge": 0.9, "pack_open": 0.8, "side_value": 0.8, "side_provisional": 0.6,
          # a guessed end of an open value: MAIN's own (any token may be its last), a SIDE
          # branch's unclosed value (the branch may be about to close it)
          "pack_close_string": 0.2, "pack_close_number": 0.4, "side_close_string": 0.4, "side_close_number": 0.5,
          # a guessed value by its rank (slots/guesses.py) and its end (the value may go on); a
          # string copied from the request closed where the request's word ends, or after one,
          # two, three more words
          "guess1": 0.4, "guess2": 0.2, "guess3": 0.1, **{f"guess{r}_end": 0.7 for r in (1, 2, 3)},
          **{f"word{w}": 0.6 for w in (1, 2, 3)}, "word0_end": 0.4, "word1_end": 0.3, "word2_end": 0.2,
          "word3_end": 0.15,
          # a copy by how many tokens before it agree with the committed text (decoders/slot_parallel.py)
          **{f"{kind}{m}": q for kind in ("copy_prompt", "copy_value", "copy_response", "copy_other", "copy_text")
             for m, q in ((1, 0.2), (2, 0.3), (4, 0.5), (8, 0.7), (16, 0.8))}}


def default_prior(source: str) -> float:
    """The rate a source starts from: a head bucket's midpoint, a kind's prior, else 0.5."""
    kind, _, rest = source.partition(":")
    if kind == "head" and rest.isdigit():
        return (int(rest) + 0.5) / HEAD_BUCKETS
    return PRIORS.get(kind, 0.5)


@dataclass
class AcceptanceStats:
    priors: dict[str, float] = field(default_factory=dict)  # source -> prior rate (default_prior otherwise)
    strength: float = PRIOR_STRENGTH
    reached: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def rate(self, source: str) -> float:
        prior = self.priors.get(source, default_prior(source))
        n = self.reached.get(source, 0)
        return (self.accepted.get(source, 0) + self.strength * prior) / (n + self.strength)

    def rates(self, sources: list[str]) -> list[float]:
        return [self.rate(s) for s in sources]

    def observe(self, parents: list[int], sources: list[str], accepted: list[int]) -> None:
        """One verification of the tree ``parents`` whose accepted path is ``accepted``."""
        on_path = set(accepted)
        for i, p in enumerate(parents):
            if p == ROOT or p in on_path:
                s = sources[i]
                self.reached[s] = self.reached.get(s, 0) + 1
                if i in on_path:
                    self.accepted[s] = self.accepted.get(s, 0) + 1

    def table(self) -> dict[str, dict]:
        """Per observed source: reached, accepted, and the current estimate (for metrics.json)."""
        return {s: {"reached": n, "accepted": self.accepted.get(s, 0), "rate": round(self.rate(s), 4)}
                for s, n in sorted(self.reached.items())}
