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
drafting, down to plain decoding. The batch's rate is measured every round, so drafting
resumes as soon as the batch thins out; to notice its drafts starting to hold, it still drafts
a probe round after ``PROBE_EVERY`` skipped ones, and each probe that leaves it not worth
doubles the wait (up to ``PROBE_MOST``): at saturation a drafter that never pays costs a
probe now and then, not one round in eight of every request.

No threshold is fixed: both sides are measured, the rate from the batch's rounds, the gain
and milliseconds from the request's own — shrunk toward what the method's drafting brought
on the launch's earlier requests (a ``DraftWorth`` of all their rounds, worth ``PRIOR_ROUNDS``
rounds of the request's own). A request's first rounds say little: a structured output's first value is
new text no draft knows, and its structure after it is nearly all drafted; stopping on
three rounds of such a value cost whole responses their speculation, while drafting on
through a few bad rounds costs only their drafting milliseconds. So a request drafts its
first ``MEASURED`` rounds, unless the launch has measured ``PRIOR_ROUNDS`` already: then
the launch's means decide from the first round (a head's first drafting, its catch-up over
the whole prompt, is its dearest). Until the launch has, only its first ``PRIOR_ROUNDS``
requests measure; the others wait for what those find (probing as above) rather than every
request of a first wave paying its first drafting at once. A launch may be a server that runs
for days while its traffic changes (tool calls in the morning, chat at night), so the launch's
means fade: a round ``LAUNCH_HORIZON`` rounds old weighs about a third of the newest.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.25  # weight of the newest round in the batch's running rate
MEASURED = 3  # drafted rounds a request is measured over before it may stop drafting
PROBE_EVERY = 8  # a request not worth its drafting still drafts a probe round after this many skipped ...
PROBE_MOST = 64  # ... and after up to this many, the wait doubling with each probe that leaves it not worth
PRIOR_ROUNDS = 8  # the launch's earlier requests count as this many rounds of a request's own
LAUNCH_HORIZON = 4096  # rounds over which a launch's means fade (module docstring)


@dataclass
class DraftWorth:
    """One request's measured drafting, over its drafted rounds: the tokens they added beyond
    the one a round commits anyway, and their milliseconds (shares of shared drafter forwards
    included). Means over every drafted round, not the latest few: a single round that
    commits one token (the response's first word, a value no draft knew) says little; with a
    ``prior`` (the launch's: every request's drafted rounds, its pricing keeps one), the means
    are shrunk toward its means, and every round this request drafts feeds it too."""

    prior: "DraftWorth | None" = None
    horizon: int | None = None  # rounds over which older rounds fade (None: every round weighs alike)
    gain_sum: float = 0.0
    ms_sum: float = 0.0
    weight: float = 0.0  # the rounds the sums hold (``rounds`` where nothing fades)
    rounds: int = 0
    skipped: int = 0  # rounds skipped in a row
    probe_every: int = PROBE_EVERY  # the current wait between probes
    measuring: bool = False  # it drafts to measure the launch's drafting, which is not measured yet
    measurers: int = 0  # (the launch's) requests that have done so

    @property
    def gain(self) -> float | None:
        return self.gain_sum / self.weight if self.rounds else None

    @property
    def ms(self) -> float | None:
        return self.ms_sum / self.weight if self.rounds else None

    def worth(self, rate: float) -> bool:
        """Draft this round, in a batch committing ``rate`` tokens per ms? Always until measured."""
        gain, ms = self.gain_sum, self.ms_sum
        if self.prior is not None and self.prior.rounds:  # this request's rounds and PRIOR_ROUNDS of the launch's
            gain, ms = gain + PRIOR_ROUNDS * self.prior.gain, ms + PRIOR_ROUNDS * self.prior.ms
        measured = self.rounds >= MEASURED or self.prior is not None and self.prior.rounds >= PRIOR_ROUNDS
        if gain >= rate * ms if measured else self._measures():
            self.skipped, self.probe_every = 0, PROBE_EVERY
            return True
        if self.skipped + 1 >= self.probe_every:  # a probe; if it leaves drafting not worth, the next waits longer
            self.skipped, self.probe_every = 0, min(2 * self.probe_every, PROBE_MOST)
            return True
        self.skipped += 1
        return False

    def _measures(self) -> bool:
        """Does this request draft to measure (neither it nor its launch is measured)? Without a
        launch, always; within one, its first ``PRIOR_ROUNDS`` requests only."""
        if self.prior is None or self.measuring:
            return True
        if self.prior.measurers < PRIOR_ROUNDS:
            self.measuring = True
            self.prior.measurers += 1
            return True
        return False

    def drafted(self, committed: int, ms: float) -> None:
        """A drafted round committed ``committed`` tokens after ``ms`` of drafting."""
        keep = 1.0 - 1.0 / self.horizon if self.horizon else 1.0
        self.gain_sum = keep * self.gain_sum + max(committed - 1, 0)
        self.ms_sum = keep * self.ms_sum + ms
        self.weight = keep * self.weight + 1.0
        self.rounds += 1
        if self.prior is not None:
            self.prior.drafted(committed, ms)


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
