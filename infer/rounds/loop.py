"""The round loop every method runs: draft → select → verify → commit, until the response stops,
for one request or a batch of them.

A method is a declaration of its proposers and its policy: a ``Drafting`` per request says
what goes with the prompt's prefill (``first``), what each round proposes (``draft``),
which of it is worth verifying (``select``), and what it learns from each verification
(``observe``, then ``settle``). A drafter with a model of its own (the EAGLE-3 head)
yields each of its forwards as a ``Step`` (``Drafting.drafting``), and a batch runs every
request's steps of one kind as one forward. The loop owns the order of those steps, the one target call
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
from typing import Any, Callable, Generator, Hashable, Iterable, Iterator, Protocol

from infer.rounds.backoff import DraftWorth, RoundRate
from infer.rounds.call import Call, Output, Segment
from infer.rounds.candidates import Candidates
from infer.rounds.decoding import Decoded, DecodeOptions, Runtime
from infer.rounds.forward import run
from infer.rounds.phases import Phases
from infer.rounds.prefixes import PrefixCache
from infer.rounds.session import MainSession, Verified
from infer.rounds.share import ALONE, Offer, Share, batch_shares
from schemafill.runtime.model import Target


@dataclass
class Proposal:
    """What one target call verifies beside the pending tokens: MAIN's candidate tree (each
    node tagged with its source) and extra segments (SIDE branches), each settled by the
    matching entry of ``owners`` (the method's own bookkeeping)."""

    cand: Candidates = field(default_factory=Candidates)
    extra: list[Segment] = field(default_factory=list)
    owners: list[Any] = field(default_factory=list)
    head_drafted: bool = False  # a drafter model spent its time on this round (its worth is measured)

    @property
    def nodes(self) -> int:
        return len(self.cand) + sum(len(seg.tokens) for seg in self.extra)


class Pricing(Protocol):
    """What selection needs to learn (``pricing/budget.NodeBudget``)."""

    def choose(self, cand: Candidates, fixed_rows: int = 1, share: Share = ALONE,
               values: list[float] | None = None) -> Candidates: ...

    def observe(self, cand: Candidates, v: Verified, head_drafted: bool = False) -> None: ...

    def host(self, ms: float) -> None: ...

    def values(self, cand: Candidates) -> list[float]:
        """Each node's chance to be on the accepted path."""
        ...

    def round_ms(self, rows: int, side: bool = False) -> float | None:
        """A round's milliseconds priced with a call of ``rows`` (with SIDE rows when ``side``),
        host work included; None where selection keeps whatever is proposed."""
        ...

    @property
    def adaptive(self) -> bool:
        """Does selection follow the host's timing (then drafting may back off, ``backoff.py``)?"""
        ...


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
        """What the prompt's prefill may verify besides the prompt (``select`` chooses from it
        as from any round's draft)."""
        return Proposal()

    def draft(self, s: MainSession) -> Proposal:
        """This round's candidates."""
        return Proposal()

    def drafting(self, s: MainSession) -> Generator[Step, Any, Proposal]:
        """``draft``, yielding the forwards of a drafter model it takes (``Step``) so that a
        batch runs every request's at once; by default ``draft`` in one go."""
        yield from ()
        return self.draft(s)

    @property
    def backs_off(self) -> bool:
        """May the loop skip this request's drafting where it does not pay? Only under a
        pricing that follows the host's timing: the fixed budget verifies what is proposed,
        and behaviour records keep their selection independent of timing."""
        return self.pricing is not None and self.pricing.adaptive

    def idle(self, s: MainSession) -> None:
        """This round drafts nothing (its drafting is not worth its time in this batch,
        ``backoff.py``): whatever the method must see of every round (the target's features
        of the newest positions) waits for its next draft."""

    def select(self, s: MainSession, p: Proposal, share: Share = ALONE, offer: Offer | None = None) -> Proposal:
        """The candidates worth their cost (all of them without ``pricing``), as rows of a call
        that also carries ``share`` (the rest of the batch); ``offer``: ``p`` as ``offer`` priced
        it this round, if it did."""
        if self.pricing is None:
            return p
        values = offer.values if offer is not None else None
        return Proposal(self.pricing.choose(p.cand, s.pending + sum(len(x.tokens) for x in p.extra), share, values),
                        p.extra, p.owners, p.head_drafted)

    def offer(self, s: MainSession, p: Proposal) -> Offer:
        """``p`` as ``select`` prices it, for the batch's best call (``share.batch_shares``):
        its MAIN tree with each node's value (nothing to choose from without ``pricing``)."""
        fixed = s.pending + sum(len(x.tokens) for x in p.extra)
        if self.pricing is None or self.pricing.round_ms(1) is None:
            return Offer([], [], fixed + len(p.cand))
        return Offer(list(p.cand.parents), self.pricing.values(p.cand), fixed)

    def observe(self, s: MainSession, p: Proposal, v: Verified) -> None:
        """What a round's verification says about the proposal (not called for the prefill)."""
        if self.pricing is not None:
            self.pricing.observe(p.cand, v, p.head_drafted)

    def observe_first(self, s: MainSession, p: Proposal, v: Verified) -> None:
        """What the prefill's verification says about the first proposal: how often its nodes
        hold, so that ``select`` prices the next requests' first proposals by it."""
        if self.pricing is not None and len(p.cand):
            self.pricing.observe(p.cand, v)

    def settle(self, s: MainSession, p: Proposal, v: Verified) -> None:
        """After every target call, the prefill's too: the method's state follows the commit."""

    def finish(self, s: MainSession) -> dict[str, Any]:
        """The response is complete; extra ``Decoded`` fields (e.g. the head's forwards)."""
        return {}


class Step(Protocol):
    """A forward of a drafter model that one request's drafting asks for mid-round. A batch
    runs the steps of equal ``key`` (the same model) as one forward: ``run_together`` returns
    each step's result, in order, each with ``ms``: its request's share of the forward."""

    @property
    def key(self) -> Hashable: ...

    @staticmethod
    def run_together(steps: list[Any]) -> list[Any]: ...


class Proposer(Protocol):
    """One source of MAIN drafts, asked every round (the EAGLE-3 head, n-gram lookup, a
    suffix tree, ...)."""

    drafted: bool  # its own model drafted the last proposal (a head: priced by what its drafts bring)

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

    def idle(self, s: MainSession) -> None:
        idle = getattr(self.proposer, "idle", None)  # a proposer that reads every round's features
        if idle is not None:
            idle(s)

    def drafting(self, s: MainSession) -> Generator[Step, Any, Proposal]:
        stepped = getattr(self.proposer, "propose_steps", None)  # a drafter model's forwards, as steps
        cand = (yield from stepped(s)) if stepped is not None else self.proposer.propose(s)
        return Proposal(cand, head_drafted=self.proposer.drafted)

    def finish(self, s: MainSession) -> dict[str, Any]:
        return self.proposer.finish(s)


LOOP_PHASES = ("initialisation", "drafting", "verification", "other")


class Stream:
    """One request in the round loop: its session, its method's policy, and the call under way.
    ``error`` holds what ended it early (a client that went away, a failing proposer); the
    batch goes on without it."""

    def __init__(self, rt: Runtime, prompt: list[int], options: DecodeOptions, drafting: Drafting) -> None:
        self.drafting = drafting
        self.phases = Phases(*LOOP_PHASES)
        self.phases.add(*drafting.phases)
        self.s = MainSession(rt.target, prompt, options.response_stop(rt.tokenizer, rt.eos, rt.max_new_tokens, rt.fmt),
                             scratch=drafting.scratch, side_capacity=drafting.side_capacity, sampler=options.sampler,
                             constraint=options.constraint, top_logprobs=options.logprobs or 0)
        with self.phases("other"):
            drafting.start(self.s, self.phases)
        self.prefilled = False
        self.proposal = Proposal()
        self.drafted = Proposal()  # this round's draft, before selection
        self.init_nodes = 0
        self.error: BaseException | None = None
        self.reused = 0  # prompt tokens whose KV came from another request's (``prefixes``)
        # is its drafting worth its host time in this batch (``backoff.py``), from what the
        # method's drafting brought on the launch's earlier requests on
        self.worth = DraftWorth(getattr(drafting.pricing, "worth", None))
        self.draft_ms: float | None = None  # this round's drafting and selection, None: it did not draft

    @property
    def done(self) -> bool:
        return self.error is not None or self.prefilled and self.s.done

    @property
    def prompt_left(self) -> int:
        """Prompt tokens whose KV is still to compute (0 once prefilled)."""
        return 0 if self.prefilled else len(self.s.prompt) - self.s.n_kv

    def draft_steps(self) -> Generator[Step, Any, None]:
        """This round's draft (``drafted``), its drafter's forwards yielded as steps."""
        self.drafted = yield from self.drafting.drafting(self.s)

    def in_pieces(self, prefill_tokens: int | None) -> bool:
        """Is more of the prompt left than this round's ``prefill_tokens`` (None: any length)?
        Then this round carries a piece of it at most."""
        return not self.prefilled and prefill_tokens is not None and self.prompt_left > prefill_tokens

    def finishes_prompt(self, prefill_tokens: int | None) -> bool:
        """Does the rest of the prompt go in this round? Then the method's first proposal is
        drafted now (``drafted``), to be priced with the round's other drafts."""
        if self.prefilled or self.in_pieces(prefill_tokens):
            return False
        with self.phases("other"):
            self.drafted = self.drafting.first(self.s)
        return True

    def next_call(self, share: Share = ALONE, prefill_tokens: int | None = None, offer: Offer | None = None
                  ) -> Call | None:
        """This round's call: a piece of the prompt (when it does not ``finishes_prompt``; None
        when none may go this round), or the selected part of the round's draft (``drafted``;
        ``offer``: as the batch priced it) — with the rest of the prompt at the prefill."""
        s, d = self.s, self.drafting
        if self.in_pieces(prefill_tokens):
            return s.chunk_call(prefill_tokens) if prefill_tokens > 0 else None
        if not self.prefilled:
            # alone, the prefill verifies the whole first proposal: priced alone, ToolSpec's names
            # and SchemaFill's forecast were cut to what the first requests' few prefills had
            # taught (one tree a request), and batch 1 slowed; in a batch its rows are priced
            with self.phases("other"):
                self.proposal = p = self.drafted if share is ALONE else d.select(s, self.drafted, share, offer)
            return s.prefill_call(p.cand.tokens, p.cand.parents, p.extra)
        started = time.perf_counter()
        with self.phases("drafting"):
            self.proposal = p = d.select(s, self.drafted, share, offer)
        if self.draft_ms is not None:
            self.draft_ms += 1e3 * (time.perf_counter() - started)
        return s.verify_call(p.cand.tokens, p.cand.parents, p.extra)

    def take(self, call: Call, out: Output, seconds: float) -> int:
        """Read this request's share of the round's forward (``seconds`` long) and let the
        method learn from it."""
        s, d, p = self.s, self.drafting, self.proposal
        phase = "verification" if call.kind == "verify" else "initialisation"  # Table 5 leaves the prefill out
        self.phases.charge(phase, seconds)
        with self.phases(phase):
            v = s.take(call, out)
        if call.kind == "chunk":
            return 0
        with self.phases("other"):
            if call.kind == "verify":
                d.observe(s, p, v)
                if self.draft_ms is not None and s.counts.target_calls > 2:
                    # not from the first round: its drafting takes in the whole prompt (the head's
                    # catch-up over every prompt position), a cost paid once, not per round
                    self.worth.drafted(v.committed, self.draft_ms)
            else:
                self.prefilled, self.init_nodes = True, p.nodes
                d.observe_first(s, p, v)
            d.settle(s, p, v)
        return v.committed

    def decoded(self) -> Decoded:
        return self.s.decoded(init_nodes=self.init_nodes, times=self.phases.times, **self.drafting.finish(self.s))

    def release(self) -> None:
        """Its arena to the next request (once it has ended and ``decoded`` was read)."""
        self.s.release()


BIG_FORWARD = 64  # rows of a forward whose time per row stands for a prompt row's
ROW_EMA = 0.2


class Batch:
    """Requests decoding together: each ``step`` is one round, one target forward for all of
    them (module docstring). ``prefill_tokens``: prompt tokens a round may carry at least while
    some request decodes (a lone request, or a batch still all prefilling, takes whole prompts;
    ``prompt_budget``)."""

    def __init__(self, target: Target, prefill_tokens: int = 256, prefixes: PrefixCache | None = None) -> None:
        self.target, self.prefill_tokens, self.prefixes = target, prefill_tokens, prefixes
        self.streams: list[Stream] = []
        self.since: float | None = None  # when the last forward ended: host time is priced from there
        self.last_rows = 0  # rows of the latest forward
        self.rate = RoundRate()  # tokens per ms of its rounds: what a request's drafting time costs the batch
        self.row_ms = 0.0  # a prompt row's forward milliseconds (``prompt_budget``)
        self.rest_ms = 0.0  # the latest round's milliseconds besides its prompt rows

    def add(self, stream: Stream) -> None:
        """``stream`` joins at the next round, from the longest kept prefix of its prompt."""
        hit = None if self.prefixes is None or stream.s.n_kv else self.prefixes.longest(stream.s.prompt)
        if hit is not None:
            prefix, n = hit
            stream.s.reuse(prefix.k, prefix.v, prefix.aux, n)
            stream.reused = n
        self.streams.append(stream)

    def step(self) -> list[Stream]:
        """One round for every request; returns those that ended in it (done, or with ``error``)."""
        self._draft([st for st in self.streams if not st.done and st.prefilled], self.rate.rate)
        streams = [st for st in self.streams if not st.done]
        budget = self.prompt_budget() if any(st.prefilled for st in streams) else None
        calls: list[tuple[Stream, Call]] = []
        # prompt pieces first (their rows are known), then every request's draft priced with the
        # rest of the call: the decoding requests', and the first proposals of prompts that end now
        priced: list[Stream] = []
        for st in streams:
            try:
                finishing = st.finishes_prompt(budget)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                st.error = e
                continue
            if st.prefilled or finishing:
                priced.append(st)
                if finishing and budget is not None:
                    budget -= st.prompt_left
            elif (call := self._build(st, calls, ALONE, budget)) is not None and budget is not None:
                budget -= call.rows
        priced.sort(key=lambda st: st.prefilled)  # prefills before verifications, as the prompts' pieces
        for st, (share, offer) in zip(priced, self._shares(priced)):
            if st.error is None:
                self._build(st, calls, share, offer=offer)
        if calls:
            began = self.since
            host = 0.0
            if self.since is not None:
                host = 1e3 * (time.perf_counter() - self.since)
                for st, call in calls:
                    if call.kind == "verify" and st.drafting.pricing is not None:
                        st.drafting.pricing.host(host)
            start = time.perf_counter()
            outs = run(self.target, [call for _, call in calls])
            seconds = time.perf_counter() - start
            self.since, self.last_rows = time.perf_counter(), outs[0].rows
            self._time_prompts(calls, host, 1e3 * seconds, outs[0].rows)
            committed = 0
            for (st, call), out in zip(calls, outs):
                try:
                    committed += st.take(call, out, seconds)
                except Exception as e:  # noqa: BLE001 - e.g. the client went away (``on_commit`` raised)
                    st.error = e
                    continue
                if self.prefixes is not None:
                    self._keep(st, call)
            if began is not None:
                self.rate.round(committed, 1e3 * (time.perf_counter() - began))
        ended = [st for st in self.streams if st.done]
        self.streams = [st for st in self.streams if not st.done]
        return ended

    def _keep(self, st: Stream, call: Call) -> None:
        """Keep what a later prompt may start from: a prompt once prefilled (requests beside it
        share its system prompt and tools), and a whole conversation once answered — prompt and
        response, so an agent's next turn, which carries it on, prefills only what it adds."""
        s = st.s
        if call.kind == "prefill":
            self.prefixes.keep(s.prompt, s.arena, s.new_aux)
        if s.done and call.kind != "chunk":
            tokens, aux = s.sequence()
            self.prefixes.keep(tokens, s.arena, aux)

    def prompt_budget(self) -> int:
        """Prompt tokens this round may carry while requests decode: ``prefill_tokens``, or more
        where the rest of a round (host work, decoding rows) takes longer than that many prompt
        rows do, so waiting prompts get at least as much of each round as the decoding requests.
        A batch whose drafting makes its rounds long would otherwise admit prompts ever more
        slowly: fewer requests decode, and their time to first token grows without bound."""
        if not self.row_ms:
            return self.prefill_tokens
        return max(self.prefill_tokens, int(self.rest_ms / self.row_ms))

    def _time_prompts(self, calls: list[tuple[Stream, Call]], host_ms: float, forward_ms: float, rows: int) -> None:
        """What a prompt row costs in a forward (a running mean over forwards of many rows,
        where the fixed part is small) and how long the latest round took besides its prompt rows."""
        prompt = sum(c.kv_rows for _, c in calls if c.kind != "verify")
        if rows >= BIG_FORWARD:
            per_row = forward_ms / rows
            self.row_ms = per_row if not self.row_ms else (1 - ROW_EMA) * self.row_ms + ROW_EMA * per_row
        self.rest_ms = host_ms + forward_ms * (rows - prompt) / max(rows, 1)

    @staticmethod
    def _draft(streams: list[Stream], rate: float) -> None:
        """Every decoding request's draft for this round, their drafters' forwards run
        together: one forward per drafter model and step for the whole batch (``Step``), each
        request charged its rows' share. A request whose drafting is not worth its time in a batch
        committing ``rate`` tokens per ms drafts nothing (``backoff.py``)."""
        asking: list[tuple[Stream, Generator[Step, Any, None], Step]] = []

        def advance(st: Stream, steps: Generator[Step, Any, None], result: Any) -> None:
            started = time.perf_counter()
            try:
                with st.phases("drafting"):
                    asking.append((st, steps, steps.send(result)))
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                st.error = e
            st.draft_ms += 1e3 * (time.perf_counter() - started)

        for st in streams:
            if not st.drafting.backs_off or st.worth.worth(rate):
                st.draft_ms = 0.0
                advance(st, st.draft_steps(), None)
                continue
            st.draft_ms, st.drafted = None, Proposal()
            try:
                with st.phases("drafting"):
                    st.drafting.idle(st.s)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                st.error = e
        while asking:
            groups: dict[Hashable, list[tuple[Stream, Generator[Step, Any, None], Step]]] = {}
            for item in asking:
                groups.setdefault(item[2].key, []).append(item)
            asking.clear()
            for group in groups.values():
                try:
                    results = group[0][2].run_together([step for _, _, step in group])
                except Exception as e:  # noqa: BLE001 - the drafter's forward failed: each request it served
                    for st, _, _ in group:
                        st.error = e
                    continue
                for (st, steps, _), result in zip(group, results):
                    st.phases.charge("drafting", result.ms / 1e3)
                    st.draft_ms += result.ms
                    advance(st, steps, result)

    @staticmethod
    def _build(st: Stream, calls: list[tuple[Stream, Call]], share: Share, budget: int | None = None,
               offer: Offer | None = None) -> Call | None:
        """``st``'s call of this round, joining ``calls`` (None when its prompt must wait or it failed)."""
        try:
            call = st.next_call(share, budget, offer)
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            st.error = e
            return None
        if call is not None:
            calls.append((st, call))
        return call

    @staticmethod
    def _shares(priced: list[Stream]) -> list[tuple[Share, Offer | None]]:
        """What each request prices its draft against — the rest of the batch's best call
        (``share.batch_shares``) over every request's candidates: decoding requests' drafts and
        the first proposals of prompts that end this round — and its ``Offer``, which its
        selection reads instead of pricing its draft again. Prompt pieces are not in it: a
        prompt's KV is owed whatever anyone drafts, and charged to the round it would make every
        node beside a prompt look cheap (rounds grow several times beyond what they earn)."""
        pricing = next((st.drafting.pricing for st in priced if st.drafting.pricing is not None
                        and st.drafting.pricing.round_ms(1) is not None), None)
        if pricing is None:  # nothing is chosen: every request verifies what it proposed
            return [(ALONE, None)] * len(priced)
        if len(priced) == 1:  # alone: its best call is its own choice
            return [(ALONE, None)]
        offers: list[Offer] = []
        for st in priced:
            try:
                offers.append(st.drafting.offer(st.s, st.drafted))
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                st.error = e
                offers.append(Offer([], [], 0, 0.0))
        side = any(st.drafted.extra for st in priced)
        return list(zip(batch_shares(offers, lambda n: pricing.round_ms(n, side)), offers))


def decode(rt: Runtime, prompt: list[int], options: DecodeOptions, drafting: Drafting) -> Decoded:
    """One request, round by round, until its response stops (closed, EOS or the cap)."""
    batch, stream = Batch(rt.target), Stream(rt, prompt, options, drafting)
    batch.add(stream)
    while batch.streams:
        batch.step()
    if stream.error is not None:
        stream.release()
        raise stream.error
    decoded = stream.decoded()
    stream.release()
    return decoded


def decode_all(target: Target, streams: Iterable[Callable[[], Stream]], concurrency: int, prefill_tokens: int = 256
               ) -> Iterator[tuple[int, Stream]]:
    """Requests decoded ``concurrency`` at a time, each made (its arena allocated) only as it
    joins: yields ``(index, stream)`` as each ends, in the order they end."""
    batch, pending, index = Batch(target, prefill_tokens), iter(enumerate(streams)), {}
    while True:
        while len(batch.streams) < concurrency and (nxt := next(pending, None)) is not None:
            i, make = nxt
            stream = make()
            index[id(stream)] = i
            batch.add(stream)
        if not batch.streams:
            return
        for stream in batch.step():
            yield index.pop(id(stream)), stream
            stream.release()  # read by now: its arena goes to the next request
