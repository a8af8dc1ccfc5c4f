"""The round loop every method runs: draft → select → verify → commit, until the response stops.

A method is a declaration of its proposers and its policy: a ``Drafting`` per request says
what goes with the prompt's prefill (``first``), what each round proposes (``draft``),
which of it is worth verifying (``select``), and what it learns from each verification
(``observe``, then ``settle``). The loop owns the order of those steps, the one target call
per round (``MainSession.verify``, which commits through ``commit.commit``), the host time
between target calls that selection prices, and the phases of the paper's Table 5. A
method never writes a loop of its own: AR is the ``Drafting`` that proposes nothing.

Greedy decoding's tokens and serial sampling's distribution are kept whatever a method
proposes, as long as its proposal depends only on the committed past: the target decides
every committed token (``session.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from infer.spec.candidates import Candidates
from infer.spec.decoding import Decoded, DecodeOptions, Runtime
from infer.spec.phases import Phases
from infer.spec.session import MainSession, Segment, Verified


@dataclass
class Proposal:
    """What one target call verifies beside the pending tokens: MAIN's candidate tree (each
    node tagged with its source) and extra segments (SIDE branches), each settled by the
    matching entry of ``owners`` (the method's own bookkeeping)."""

    cand: Candidates = field(default_factory=Candidates)
    extra: list[Segment] = field(default_factory=list)
    owners: list[Any] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return len(self.cand) + sum(len(seg.tokens) for seg in self.extra)


class Pricing(Protocol):
    """What selection needs to learn (``pricing/budget.NodeBudget``)."""

    def choose(self, cand: Candidates, fixed_rows: int = 1) -> Candidates: ...

    def observe(self, cand: Candidates, v: Verified) -> None: ...

    def host(self, ms: float) -> None: ...


class Drafting:
    """One request's proposers and policy. The defaults propose nothing (AR), select with
    ``pricing`` when there is one, and learn only what ``pricing`` learns."""

    scratch: int = 0  # most MAIN tree nodes one verification may carry
    side_capacity: int = 0  # arena rows for SIDE branches
    phases: tuple[str, ...] = ()  # phases the method times beside the loop's

    def __init__(self, pricing: Pricing | None = None) -> None:
        self.pricing = pricing

    def start(self, s: MainSession, phases: Phases) -> None:
        """The session exists, nothing is computed yet."""

    def first(self, s: MainSession) -> Proposal:
        """What the prompt's prefill verifies besides the prompt."""
        return Proposal()

    def draft(self, s: MainSession) -> Proposal:
        """This round's candidates."""
        return Proposal()

    def select(self, s: MainSession, p: Proposal) -> Proposal:
        """The candidates worth their cost (all of them without ``pricing``)."""
        if self.pricing is None:
            return p
        return Proposal(self.pricing.choose(p.cand, fixed_rows=s.pending + sum(len(x.tokens) for x in p.extra)),
                        p.extra, p.owners)

    def observe(self, s: MainSession, p: Proposal, v: Verified) -> None:
        """What a round's verification says about the proposal (not called for the prefill)."""
        if self.pricing is not None:
            self.pricing.observe(p.cand, v)

    def settle(self, s: MainSession, p: Proposal, v: Verified) -> None:
        """After every target call, the prefill's too: the method's state follows the commit."""

    def finish(self, s: MainSession) -> dict[str, Any]:
        """The response is complete; extra ``Decoded`` fields (e.g. the head's forwards)."""
        return {}


class Proposer(Protocol):
    """One source of MAIN drafts, asked every round (the EAGLE-3 head, n-gram lookup, a
    suffix tree, ...)."""

    def start(self, s: MainSession) -> None: ...

    def propose(self, s: MainSession) -> Candidates: ...

    def finish(self, s: MainSession) -> dict[str, Any]: ...


class Proposing(Drafting):
    """The policy of a method with one proposer: every round, what it proposes, priced."""

    def __init__(self, proposer: Proposer, scratch: int, pricing: Pricing | None = None) -> None:
        super().__init__(pricing)
        self.proposer, self.scratch = proposer, scratch

    def start(self, s: MainSession, phases: Phases) -> None:
        self.proposer.start(s)

    def draft(self, s: MainSession) -> Proposal:
        return Proposal(self.proposer.propose(s))

    def finish(self, s: MainSession) -> dict[str, Any]:
        return self.proposer.finish(s)


LOOP_PHASES = ("initialisation", "drafting", "verification", "other")


def decode(rt: Runtime, prompt: list[int], options: DecodeOptions, drafting: Drafting) -> Decoded:
    """One request, round by round, until its response stops (closed, EOS or the cap)."""
    phases = Phases(*LOOP_PHASES)
    phases.add(*drafting.phases)
    s = MainSession(rt.target, prompt, options.response_stop(rt.tokenizer, rt.eos, rt.max_new_tokens, rt.fmt),
                    scratch=drafting.scratch, side_capacity=drafting.side_capacity, sampler=options.sampler,
                    constraint=options.constraint)
    with phases("other"):
        drafting.start(s, phases)
        p = drafting.first(s)
    with phases("initialisation"):  # the paper's Table 5 leaves the prefill out of its phases
        v = s.prefill(p.cand.tokens, p.cand.parents, p.extra)
    init_nodes = p.nodes
    with phases("other"):
        drafting.settle(s, p, v)
    pricing = drafting.pricing
    since = time.perf_counter()  # host time between target calls is what selection prices
    while not s.done:
        with phases("drafting"):
            p = drafting.select(s, drafting.draft(s))
        if pricing is not None:
            pricing.host(1e3 * (time.perf_counter() - since))
        with phases("verification"):
            v = s.verify(p.cand.tokens, p.cand.parents, p.extra)
        since = time.perf_counter()
        with phases("other"):
            drafting.observe(s, p, v)
            drafting.settle(s, p, v)
    return s.decoded(init_nodes=init_nodes, times=phases.times, **drafting.finish(s))
