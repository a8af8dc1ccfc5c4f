"""Whether a request's drafting is worth its host time this round: speculation that backs off
under load and comes back when load falls. Pure: the standard library only.

Selection (``infer/pricing/selection.py``) keeps only the nodes worth their rows, but the
drafting that proposed them is spent before it chooses: a head's forwards, a parser, a
packer, SIDE bookkeeping — host time in the round, serial on a CPU, that delays every request
of the batch. In a round that commits ``rate`` tokens per millisecond (the whole batch's,
measured), ``ms`` of one request's drafting costs ``rate · ms`` tokens; drafting pays when
what it adds beyond the one token every round commits anyway — ``gain``, measured over the
request's drafted rounds — is at least that. Alone, a round's rate is the request's own and
drafting almost always pays; beside 63 other requests the same milliseconds cost 64 times
the tokens, and a drafter that brings little (a head the target rarely follows) stops
drafting, down to plain decoding. It still drafts one round in ``PROBE_EVERY`` to keep
measuring, so it speculates again once the batch thins out or its drafts start to hold.

No threshold is fixed: both sides are measured, the rate from the batch's rounds, the gain
and milliseconds from the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.25  # weight of the newest round in the running means
PROBE_EVERY = 8  # a request not worth its drafting still drafts one round in this many


@dataclass
class DraftWorth:
    """One request's measured drafting: tokens it adds per drafted round beyond the one a
    round commits anyway, and its milliseconds per round (its share of shared drafter
    forwards included)."""

    gain: float | None = None
    ms: float | None = None
    skipped: int = 0  # rounds skipped in a row

    def worth(self, rate: float) -> bool:
        """Draft this round, in a batch committing ``rate`` tokens per ms? Always until measured."""
        if self.gain is None or self.ms is None or self.gain >= rate * self.ms or self.skipped + 1 >= PROBE_EVERY:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def drafted(self, committed: int, ms: float) -> None:
        """A drafted round committed ``committed`` tokens after ``ms`` of drafting."""
        gain = max(committed - 1, 0)
        self.gain = gain if self.gain is None else (1 - EMA) * self.gain + EMA * gain
        self.ms = ms if self.ms is None else (1 - EMA) * self.ms + EMA * ms


@dataclass
class RoundRate:
    """Committed tokens per millisecond of the batch's rounds (host time between forwards and
    the forward itself), a running mean."""

    rate: float = 0.0

    def round(self, tokens: int, ms: float) -> None:
        if ms <= 0:
            return
        r = tokens / ms
        self.rate = r if not self.rate else (1 - EMA) * self.rate + EMA * r
