"""SchemaFill's policy in the round loop (paper §4; docs/design.md, "SchemaFill, step by step"):
what one request proposes each round, and which of it is worth verifying.

1. **Forecast** (``start``): BM25 ranks the catalog, the cycled ranking gives ``forecast_budget``
   call groups, each a ``CallPlan`` (tool, predicted keys) whose values SIDE branches prepare
   (``forecast.py``).
2. **Initialise** (``first``, with the prompt's prefill): MAIN candidates — for each forecast
   tool the canonical response up to its first value — merged into one tree, and the
   prefixes of the first SIDE branches. The greedy path through the candidates is MAIN's
   start (the longest accepted key prefix wins by construction).
3. **Align** (start of ``draft``): MAIN's parse state rebinds the current call's plan to the
   realized tool, retires branches of finished calls and realized fields, and keeps branches
   for the current and next call only (``align.py``, ``side.py``).
4. **MAIN proposal**: the EAGLE-3 head's draft tree, merged with prompt-lookup copies and the
   packer's chain (structural bridges and prepared values across fields and calls,
   ``packer.py``), tokenised the way the whole response would be.
5. **SIDE steps**: each branch's pending token (the target's previous choice for it) and,
   with ``side_depth`` 1 (the paper's), the head's top-1 draft after it, under the branch's
   private context. A value is *prepared* when its literal closes; the packer then offers it.
6. **Select** (``select``): MAIN's nodes and SIDE steps compete for the round's rows by their
   expected accepted tokens against the measured cost curve; the loop verifies them in one
   target call and commits MAIN's accepted path (SIDE branches only advance, provisionally).

Formats that write a call's name after its arguments (``hermes3``): the candidates at
initialisation are the forecast tools' first keys (``{"arguments": {"<key>":``; tools that
share it share the chain), the packer writes the name from the plan after the arguments,
and until MAIN writes the name the plan follows the keys MAIN writes
(``align.rebind_by_keys``); a SIDE context ends before any name, so a branch or prepared
value of a key serves whichever tool the call turns out to be.

Ablations (``decode.ablation``): A = EAGLE-3 only; B = + forecast-guided initialisation,
structural packing and prompt-lookup copies (no prepared values); C = + SIDE branches,
packing within a call; D = + packing across calls (full SchemaFill).

Decisions where the paper is silent:

* The head drafts a SIDE branch's next token greedily from its own KV of the branch's private
  context (``side.SideContexts``), so a branch advances one or two tokens per round.
* ``pack_provisional``: the packer also chains through the unclosed value a branch has so
  far, so MAIN catches up with a long value a branch started rounds earlier.
* ``side_optional``: the schema's keys the forecast did not predict get branches too, after
  every predicted one, so a value is ready if MAIN writes an optional key (the packer never
  proposes an unpredicted key by itself).
* ``copy_len``: MAIN's tree also gets prompt-lookup chains (``lookup.copy_matches``) — the
  tokens after the committed text's longest suffix in the prompt and in the response so far:
  values are mostly copied from the request, and a small target's responses repeat
  themselves. The response's copy runs on through its own tokens, so a response caught in
  a loop is proposed ``copy_len`` tokens ahead. Inside a string or number, the value's text
  so far is also looked up in the prompt's text (``lookup.text_copies``) and the text after
  it proposed, tokenised as the response would be: a value's words follow a quote, the
  request's a space, so they are other tokens and the token copies miss them. SIDE branches
  get no copies.
* ``guess_ends``: the packer closes an open value where its text may stop, and where a chain
  goes on to a next call, the response's end is proposed beside it.
* SIDE rows are spent only while they pay: a launch-wide ledger measures the tokens MAIN
  took through packed SIDE values per SIDE row, and new SIDE contexts open only while that
  beats what a row costs at the rate rounds promise (on a CPU, whose rows cost
  milliseconds, they soon stop; on a GPU they go on).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Generator

from infer.pricing.acceptance import PRIOR_STRENGTH
from infer.pricing.budget import NodeBudget
from infer.proposers.head import HeadDrafter, TreeBudget
from infer.proposers.lookup import copy_matches, text_copies
from infer.rounds.candidates import Candidates
from infer.rounds.loop import Drafting, Proposal
from infer.rounds.phases import Phases
from infer.rounds.session import MainSession, Verified
from infer.rounds.share import ALONE, Offer, Share
from infer.rounds.tree import ROOT, chain, merge
from infer.slots.align import current_call, rebind, rebind_by_keys, written_keys
from infer.slots.forecast import call_plan, forecast_groups, rank_tools
from infer.slots.guesses import request_numbers, value_guesses
from infer.slots.packer import (CLOSES, GUESS, GUESS_END, NEXT, PROVISIONAL, VALUE, CallPlan, propose_tagged,
                                token_kinds, value_start)
from infer.slots.side import SideBranches, SideContexts
from schemafill.config import ABLATIONS, DecodeConfig
from schemafill.contract.response_format import ResponseFormat, continuation_ids, stable_continuation_ids
from schemafill.contract.toolcall import ToolRequest

WORD_ENDS = frozenset(" ,.;:!?)")  # where a value copied from prose may end
SIDE_DRAFT = "side_draft:1"  # the head's draft after a SIDE branch's pending token
SIDE_CHAIN = "side_"  # packed-chain sources from a SIDE value on (pricing/acceptance.py)


def copy_source(kind: str, matched: int) -> str:
    """A copy's source by how many tokens before it agree with the committed text (1, 2,
    3-7, 8-15, 16+): a copy after a long agreement (a value quoted from the request, a
    response repeating itself) holds far more often than one after a lone token. A copy
    from the prompt inside a value (``copy_value``) and outside one (``copy_prompt``, where
    the prompt's schema text rarely is what comes) are learnt apart too, and a value's text
    copy (``copy_text``) by the characters matched."""
    bucket = next(b for b, top in ((1, 1), (2, 2), (4, 7), (8, 15), (16, None)) if top is None or matched <= top)
    return f"{kind}{bucket}"


@dataclass(frozen=True)
class SchemaFillConfig:
    budget: TreeBudget  # the head's MAIN tree
    forecast_budget: int = 3  # B call groups
    ablation: str = "D"
    side_depth: int = 1
    pack_provisional: bool = True  # pack a value's unclosed SIDE prefix too
    side_optional: bool = True  # branches for the schema keys the forecast did not predict, last
    copy_len: int = 4  # MAIN chains copied from the prompt and from the response, at most this long; 0 = off
    guess_ends: bool = False  # the packer guesses where an open value, and the response, end
    value_guesses: int = 0  # chains through this many guesses of an unprepared value (``guesses.py``); 0 = off
    max_branches: int = 8
    max_value_tokens: int = 48
    max_chain: int = 48
    chain_head_depth: int = 0  # the head tree's depth in rounds the packer proposes a chain (0: the budget's)

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise ValueError(f"decode.ablation must be one of {ABLATIONS}, got {self.ablation!r}")
        if self.side_depth not in (0, 1):
            raise ValueError(f"decode.side_depth must be 0 (SIDE branches advance by the target's token) or 1 "
                             f"(plus one head-drafted token per round, the paper's), got {self.side_depth}")

    @classmethod
    def of(cls, decode: DecodeConfig, **overrides: Any) -> "SchemaFillConfig":
        """Every setting ``decode.*`` names (the others keep their defaults), then ``overrides``."""
        named = {f.name for f in fields(cls)} & {f.name for f in fields(decode)}
        return cls(budget=TreeBudget.of(decode), **{**{n: getattr(decode, n) for n in named}, **overrides})

    # what each ablation stage adds (A = EAGLE-3 inside this loop)
    @property
    def forecasts(self) -> bool:  # B: forecast-guided initialisation, structural packing, copies
        return self.ablation != "A"

    @property
    def sides(self) -> bool:  # C: SIDE branches prepare values
        return self.ablation in ("C", "D")

    @property
    def cross_calls(self) -> bool:  # D: the packer chains across calls
        return self.ablation == "D"

    @property
    def side_capacity(self) -> int:  # arena rows for SIDE branches
        return self.max_branches * (64 + self.max_value_tokens) if self.sides else 0

    @property
    def scratch(self) -> int:
        # MAIN tree rows: the head's; the packer's chain, its ending, and its guesses (of the
        # value MAIN writes, of the next, of where MAIN's string ends); three token and two text copies
        return self.budget.total + (2 + 3 * self.value_guesses) * self.max_chain + 5 * self.copy_len


@dataclass
class SideLedger:
    """A launch's return on SIDE rows: rows spent (initialisation included), and the tokens
    MAIN accepted from packed chains through SIDE values (the values and the structure
    after them)."""

    rows: int = 0
    credit: int = 0

    @property
    def per_row(self) -> float:
        """Tokens per SIDE row, from a prior of 0.5."""
        return (self.credit + PRIOR_STRENGTH * 0.5) / (self.rows + PRIOR_STRENGTH)


class SlotDrafting(Drafting):
    """One request's SchemaFill rounds over a launch's head, pricing and SIDE ledger.

    ``groups`` (catalog indices, one per call) replaces the BM25 forecast and ``values``
    ((call, key) -> value literal) pre-fills prepared values: for tests and for callers who
    know the call layout. Neither can change the output (or its distribution, with a
    sampler), only the speed."""

    phases = ("forecast",)

    def __init__(self, cfg: SchemaFillConfig, drafter: HeadDrafter, budget: NodeBudget, ledger: SideLedger,
                 request: ToolRequest, prompt: list[int], tokenizer: Any, eos: frozenset[int], fmt: ResponseFormat,
                 groups: list[int] | None = None, values: dict[tuple[int, str], str] | None = None) -> None:
        super().__init__(budget)
        self.budget: NodeBudget = budget
        self.cfg, self.drafter, self.ledger, self.tokenizer, self.eos, self.fmt = \
            cfg, drafter, ledger, tokenizer, eos, fmt
        self.request, self.prompt, self.groups, self.values = request, prompt, groups, values
        self.prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)  # what text copies read
        # what a number value is guessed from: the conversation's numbers, not the catalog's
        self.numbers = request_numbers("\n".join(m["content"] for m in request.messages
                                                 if isinstance(m.get("content"), str)))
        self.scratch, self.side_capacity = cfg.scratch, cfg.side_capacity
        self.functions = {fn["name"]: fn for fn in request.slot_functions}
        self.plans: list[CallPlan] = []

    # ---------------------------------------------------------------- the loop's steps
    def start(self, s: MainSession, phases: Phases) -> None:
        self.timed = phases
        with phases("forecast"):
            self.plans = self._forecast()
        self.drafter.begin(s.layout.positions, s.layout.capacity)
        # before stage C there are no branches: the SIDE steps do nothing
        cfg = self.cfg
        self.side = SideBranches(self.tokenizer, self.eos, SideContexts(self.tokenizer, len(self.prompt),
                                                                        s.layout.side_base, s.layout.side_capacity,
                                                                        self.fmt),
                                 cfg.max_branches if cfg.sides else 0, cfg.max_value_tokens, cfg.side_optional,
                                 cfg.side_depth, self.fmt)

    def first(self, s: MainSession) -> Proposal:
        """MAIN's candidates at initialisation and the first SIDE prefixes: for each forecast
        tool, the canonical response up to its first value's start, merged into one tree."""
        texts = [self._first_text(p) for p in self.plans]  # name-last formats: one text for tools alike
        candidates = [chain(stable_continuation_ids(self.tokenizer, [], "", text, then, self.fmt)[: self.cfg.max_chain])
                      for text, then in dict.fromkeys(texts)]
        tree = Candidates.tree(*(merge(candidates) if candidates else ([], [])), "init")
        state = s.stop.parser.state
        guessed = [c for plan in {p.tool: p for p in self.plans if p.keys}.values()
                   for c in self._guessed(s, "", state, [plan], None, (0, plan.keys[0]))]
        if guessed:
            tree = Candidates.merged([tree, *guessed], self.budget.stats.rate)
        extra, owners = self.side.open_first(self.plans) if self._sides_pay() else ([], [])
        self.ledger.rows += sum(len(seg.tokens) for seg in extra)  # SIDE rows too: what SIDE branches cost
        return Proposal(tree, extra, owners)

    def _first_text(self, plan: CallPlan) -> tuple[str, str]:
        """A first call of ``plan``'s tool up to its first value's start (the schema's quote or
        bracket: ``packer.value_start``), and what the value may start with after it."""
        if not plan.keys:
            return self.fmt.header + self.fmt.call_header(plan.tool), ""
        opening, then = value_start(plan.types.get(plan.keys[0], ""))
        return self.fmt.field_prefix(plan.tool, plan.keys[0]) + " " + opening, then

    def idle(self, s: MainSession) -> None:
        self.drafter.idle(s)

    def drafting(self, s: MainSession) -> Generator[Any, Any, Proposal]:
        side, plans = self.side, self.plans
        with self.timed("other"):  # align the plans and branches with what MAIN realized
            text, state = s.stop.parsed_text, s.stop.parser.state
            current = current_call(state)
            if plans and state.tool_name is not None:
                side.remap(rebind(plans, state.call_index, state.tool_name, self.functions))
            elif plans and state.call_index is not None and not self.fmt.name_first:
                # the name comes after the arguments: follow the keys until it does
                keys, typing = written_keys(text, state)
                side.remap(rebind_by_keys(plans, state.call_index, keys, self.functions, typing))
            realized = {(current, k) for k, _, _ in state.spans}
            side.retire_stale(plans, current, realized)
            side.activate(plans, current, realized)
        # MAIN first: the head's catch-up writes the prompt's head entries that SIDE drafts read
        cand = yield from self._main_tree(s, text, state)
        with self.timed("other"):
            stepping = side.reserve_steps()
        yield from side.draft(stepping, self.drafter, s.prompt_aux)
        with self.timed("other"):
            extra, owners = side.segments(open_new=self._sides_pay())
        return Proposal(cand, extra, owners, self.drafter.drafted)

    def select(self, s: MainSession, p: Proposal, share: Share = ALONE, offer: Offer | None = None) -> Proposal:
        """The MAIN nodes and SIDE steps worth their cost this round, chosen together: MAIN's
        by their chance to be accepted, a SIDE step's rows by the ledger's return on SIDE rows,
        its head-drafted second row by how often SIDE drafts hold; MAIN's nodes alone compete
        against MAIN and SIDE together. New SIDE contexts (opened only while SIDE rows pay)
        always go. The current call's steps compete too: on a CPU a call of a few rows costs
        what one row does, so keeping them regardless would hold every round at several rows.
        In a batch, they are rows of the call ``share`` describes."""
        cand, extra, owners = p.cand, p.extra, p.owners
        if not self.budget.active:
            return Proposal(self.budget.choose(cand, self._fixed(s, p), share), extra, owners, p.head_drafted)
        offer, first_rows = self._forest(s, p, offer)
        parents, values, fixed = offer.parents, offer.values, offer.fixed_rows
        kept, rate = self.budget.best(parents, values, fixed, bool(extra), share)
        if first_rows and None not in first_rows:
            # a call without SIDE rows may cost less than its row count says (their private
            # contexts are attended apart): MAIN's nodes alone compete as a whole
            alone, solo = self.budget.best(cand.parents, values[:len(cand)], fixed, False, share)
            if solo > rate:
                kept, rate = alone, solo
        self.budget.commit(rate)
        kept = set(kept)
        main = cand.subset(sorted(i for i in kept if i < len(cand)))
        rows = [len(seg.tokens) if first is None else sum(first + r in kept for r in range(len(seg.tokens)))
                for seg, first in zip(extra, first_rows)]
        extra, owners = self.side.trim(extra, owners, rows)
        return Proposal(main, extra, owners, p.head_drafted)

    def offer(self, s: MainSession, p: Proposal) -> Offer:
        return self._forest(s, p)[0] if self.budget.active else super().offer(s, p)

    def _fixed(self, s: MainSession, p: Proposal) -> int:
        """Rows the call carries whatever is chosen: pending tokens, new SIDE contexts."""
        return s.pending + sum(len(seg.tokens) for seg, step in zip(p.extra, self.side.steps(p.owners)) if not step)

    def _forest(self, s: MainSession, p: Proposal, offer: Offer | None = None) -> tuple[Offer, list[int | None]]:
        """MAIN's tree and every SIDE step's rows as one forest in selection's currency (``offer``
        where this round's is given), and the index of each segment's first row in it (None: a
        new context, always sent)."""
        first_rows: list[int | None] = []
        n = len(p.cand)
        for seg, step in zip(p.extra, self.side.steps(p.owners)):
            first_rows.append(n if step else None)
            n += len(seg.tokens) if step else 0
        if offer is None:
            parents, values = list(p.cand.parents), self.budget.values(p.cand)
            worth, draft_rate = self.ledger.per_row, self.budget.stats.rate(SIDE_DRAFT)
            for seg, first in zip(p.extra, first_rows):
                if first is not None:
                    for r in range(len(seg.tokens)):
                        parents.append(ROOT if r == 0 else len(parents) - 1)
                        values.append(worth if r == 0 else worth * draft_rate)
            offer = Offer(parents, values, self._fixed(s, p))
        return offer, first_rows

    def observe(self, s: MainSession, p: Proposal, v: Verified) -> None:
        self.budget.observe(p.cand, v, p.head_drafted)
        self.ledger.rows += sum(len(seg.tokens) for seg in p.extra)
        self.ledger.credit += sum(p.cand.sources[i].startswith(SIDE_CHAIN) for i in v.accepted)
        for seg, step, choices in zip(p.extra, self.side.steps(p.owners), v.extra_choices):
            if step and len(seg.tokens) == 2:  # did the target choose the head's SIDE draft?
                self.budget.stats.observe([ROOT], [SIDE_DRAFT], [0] if choices[0] == seg.tokens[1] else [])

    def settle(self, s: MainSession, p: Proposal, v: Verified) -> None:
        self.side.settle(p.owners, v)
        if s.counts.target_calls > 1:  # a round: prepared values go to their plans
            self.side.collect(self.plans)

    def finish(self, s: MainSession) -> dict:
        return {"head_forwards": self.drafter.forwards, "head_ms": round(self.drafter.ms, 3)}

    # ---------------------------------------------------------------- policy
    def _sides_pay(self) -> bool:
        """Do new SIDE contexts pay for their rows? Only while a SIDE row has returned at least
        what a row costs at the rate rounds promise (the curve's per-row slope). Steps of
        open branches compete in selection either way."""
        if not self.budget.active or not self.budget.rate:
            return True
        return self.ledger.per_row >= self.budget.rate * self.budget.cost.per_row

    def _forecast(self) -> list[CallPlan]:
        """One plan per forecast call group (none at stage A), with any given values."""
        if not self.cfg.forecasts:
            return []
        groups = self.groups
        if self.request.object_only:  # a structured output: its one object, its fields the slots
            groups = [0]
        elif groups is None:
            groups = forecast_groups(rank_tools(self.request), self.cfg.forecast_budget)
        plans = [call_plan(self.request.slot_functions[g]) for g in groups]
        for (j, key), literal in (self.values or {}).items():
            if j < len(plans):
                plans[j].values[key] = literal
        return plans

    def _main_tree(self, s: MainSession, text: str, state: Any) -> Generator[Any, Any, Candidates]:
        """The head's draft tree, merged with prompt-lookup copies and the packer's chain."""
        cfg, plans = self.cfg, self.plans
        parts, copies = [], []
        if cfg.copy_len and cfg.forecasts:
            # values are mostly copied from the request, and a response repeats itself
            for source, kind, own in ((self.prompt, "copy_value" if state.in_value else "copy_prompt", False),
                                      (s.response, "copy_response", True)):
                # the latest occurrence's continuation, and in the response one that went another
                # way after the same text (a response alternating between two calls)
                for rank, (copied, matched) in enumerate(copy_matches(s.tokens, source, length=cfg.copy_len,
                                                                      overlap=own, most=2 if own else 1)):
                    parts.append(Candidates.chain(copied, copy_source(kind if not rank else "copy_other", matched)))
            if state.literal is not None:  # the open value by its text: it follows a quote, the prose a space
                kind, written = state.literal
                copies = text_copies(written, self.prompt_text, kind, length=4 * cfg.copy_len)
                for copied, matched in copies:
                    ids = continuation_ids(self.tokenizer, s.response, text, copied, self.fmt)[: cfg.copy_len]
                    parts.append(Candidates.chain(ids, copy_source("copy_text", matched)))
        certain = False
        if plans:
            ahead = self.side.provisional(plans) if cfg.pack_provisional else None
            packed, kinds, slot = self._packed(s, text, state, plans, ahead)
            if kinds:
                parts.append(packed)
                certain = kinds[0] not in CLOSES
                if cfg.guess_ends and state.calls_started and NEXT in kinds:
                    # the chain goes on to a next call: the response may end after this one instead
                    ending, ends, _ = self._packed(s, text, state, plans[:state.calls_started], ahead)
                    parts += [ending] if ends else []
            writing = (state.call_index, state.field) if state.in_value and state.field is not None else None
            for guessed in dict.fromkeys((writing, slot)):  # the value MAIN writes may go on as a guess
                parts += self._guessed(s, text, state, plans, ahead, guessed)
            if writing and state.value_type == "string" and copies:
                parts += self._word_ends(s, text, state, plans, ahead, writing, copies[0][0])
        # beside a packed chain the head's deeper levels are rarely taken, and each costs a
        # head forward every round: there it may draft fewer levels (its catch-up runs either
        # way); a chain that starts by guessing MAIN's value ends here does not count
        depth = cfg.chain_head_depth if certain and cfg.chain_head_depth else None
        head = yield from self.drafter.candidate_steps(s.tokens, s.new_aux, depth)
        return Candidates.merged([head, *parts],
                                 self.budget.stats.rate)

    def _packed(self, s: MainSession, text: str, state: Any, plans: list[CallPlan],
                ahead: dict[tuple[int, str], str] | None, guessed: tuple[tuple[int, str], str, str] | None = None
                ) -> tuple[Candidates, list[str], tuple[int, str] | None]:
        """The packer's chain after MAIN's committed text, tokenised as the whole response
        would be, each token's kind (its source tags them; no kinds when the packer has
        nothing), and the (call, key) of the unprepared value it stops before. ``guessed``:
        (slot, literal, source), a guess of that value the chain runs through, its tokens
        tagged ``source`` and its end ``source_end``."""
        cfg = self.cfg
        suffix, kinds, then, slot = propose_tagged(text, state, plans, cross_calls=cfg.cross_calls, provisional=ahead,
                                                   fmt=self.fmt, close=cfg.guess_ends,
                                                   guessed={guessed[0]: guessed[1]} if guessed else None)
        packed = stable_continuation_ids(self.tokenizer, s.response, text, suffix, then, self.fmt)[: cfg.max_chain]
        if not packed:
            return Candidates(), [], slot
        kinds = token_kinds(self.tokenizer, s.response, text, suffix, kinds[:len(suffix)], packed, self.fmt)
        # from the first prepared value on, the chain exists only because a SIDE branch prepared
        # it (the structure, the guessed end of MAIN's own value and a guessed value are not)
        first = next((i for i, k in enumerate(kinds) if k in (VALUE, PROVISIONAL)), len(kinds))
        tags = [guessed[2] if k == GUESS else f"{guessed[2]}_end" if k == GUESS_END else
                f"{'side' if i >= first else 'pack'}_{k}" for i, k in enumerate(kinds)]
        return Candidates.tagged_chain(packed, tags), kinds, slot

    def _guessed(self, s: MainSession, text: str, state: Any, plans: list[CallPlan],
                 ahead: dict[tuple[int, str], str] | None, slot: tuple[int, str] | None) -> list[Candidates]:
        """Chains through the likeliest literals of ``slot``'s value (``guesses.py``: the schema's
        choices, the request's numbers), each tagged by its rank so that how often each rank
        holds is learnt."""
        if not self.cfg.value_guesses or slot is None or slot[0] is None or slot[0] >= len(plans):
            return []
        plan, key = plans[slot[0]], slot[1]
        partial = text[state.value_start:] if state.in_value and (state.call_index, state.field) == slot else ""
        literals = value_guesses(plan.types.get(key, ""), plan.choices.get(key, ()), self.numbers,
                                 text[:len(text) - len(partial)], self.cfg.value_guesses, partial)
        return self._through(s, text, state, plans, ahead, slot,
                             [(literal, f"guess{rank}") for rank, literal in enumerate(literals, 1)])

    def _word_ends(self, s: MainSession, text: str, state: Any, plans: list[CallPlan],
                   ahead: dict[tuple[int, str], str] | None, slot: tuple[int, str], copied: str) -> list[Candidates]:
        """The string MAIN is writing, closed where its text copy (``copied``) ends a word: now,
        if the request's word ends here, then after each next word, up to ``value_guesses``
        ends. A value copied from the request ends where a word does, and the round that
        writes its last word otherwise ends there, one token short of the structure after it."""
        if not self.cfg.value_guesses:
            return []
        partial = text[state.value_start:]
        ends = [i for i in range(len(copied)) if copied[i] in WORD_ENDS and (not i or copied[i - 1] not in WORD_ENDS)]
        ends = (ends + [len(copied)])[: self.cfg.value_guesses]
        # tagged by the words after MAIN's text: word0 closes it now, where the request's word ends
        return self._through(s, text, state, plans, ahead, slot,
                             [(partial + copied[:i] + '"', f"word{words + bool(ends[0])}")
                              for words, i in enumerate(ends) if "\\" not in copied[:i]])

    def _through(self, s: MainSession, text: str, state: Any, plans: list[CallPlan],
                 ahead: dict[tuple[int, str], str] | None, slot: tuple[int, str], guesses: list[tuple[str, str]]
                 ) -> list[Candidates]:
        """The packer's chains through each (literal, source) of ``guesses`` as ``slot``'s value:
        each source (a rank, a word count) learns apart how often it holds. None where a SIDE
        branch is preparing that value: its text is the better guess."""
        if ahead and slot in ahead:
            return []
        chains = [self._packed(s, text, state, plans, ahead, (slot, literal, source))[0] for literal, source in guesses]
        return [c for c in chains if len(c)]
