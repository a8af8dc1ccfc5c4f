"""SchemaFill: forecast, SIDE branches, cross-call packing, one shared tree verification.

Our reading of paper §4 (DESIGN §4), round by round:

1. **Forecast** (once): BM25 ranks the catalog, the cycled ranking gives ``budget`` call
   groups, each a ``CallPlan`` (tool, predicted keys) whose values SIDE branches prepare.
2. **Initialise** (one target call): the prompt, MAIN candidates — for each forecast tool
   the canonical response up to its first value — merged into one tree, and the prefixes
   of the first SIDE branches. The greedy path through the candidates is MAIN's start
   (the longest accepted key prefix wins by construction).
3. **SIDE branch** for slot (call j, tool t, field f): private context = prompt + an
   ordinal hint for j ≥ 2 ("Select the second request.") + the canonical text a call of t
   has up to f's colon, tokenised as one piece like MAIN's response. Each round the branch
   contributes its pending token; the target's choice there is its next token, under the
   branch's own context only. A value is *prepared* when its literal closes; it is then
   offered to the packer and the branch is freed. Provisional: nothing of a branch is
   ever emitted or moved into MAIN.
4. **MAIN proposal**: the EAGLE-3 head's draft tree, merged with the packer's chain
   (structural bridges + prepared values across fields and calls), tokenised the way
   the whole response would be.
5. **Verify** MAIN and every active branch in one target call (``MainSession``): MAIN keeps
   its longest greedy path plus the correction; each branch advances by one target token.
6. **Align**: MAIN's parse state rebinds the plan of the current call to the realized tool
   (swapping in a later group with that tool, or a fresh plan from the catalog), retires
   branches of finished calls and realized fields, and keeps branches only for the
   current and next call. Stops with MAIN (first closed object, EOS, or the cap).

Formats that write a call's name after its arguments (``hermes3``): the candidates at
initialisation are the forecast tools' first keys (``{"arguments": {"<key>":``; tools that
share it share the chain), the packer writes the name from the plan after the arguments,
and until MAIN writes the name the plan follows the keys MAIN writes
(``align.rebind_by_keys``); a SIDE context ends before any name, so a branch or prepared
value of a key serves whichever tool the call turns out to be.

Ablations (``decode.ablation``): A = EAGLE-3 only; B = + forecast-guided initialisation and
structural packing (no prepared values), prompt-lookup copies; C = + SIDE branches, packing within a call;
D = + packing across calls (full SchemaFill).

Decisions where the paper is silent: each round a SIDE branch contributes its pending
token (the target's previous choice for it) and, with ``side_depth`` 1 (the paper's), the
head's top-1 draft after it, so a branch advances one or two tokens per round; the head
drafts greedily from its own KV of the branch's private context (``SideContexts``).
Beyond the paper (``pack_provisional``, on by default): the packer also gets the unclosed
value a branch has so far and chains through it, so MAIN catches up with a long value a
branch started rounds earlier (BFCL, 10 requests, full head: 251 -> 243 target calls).
Slots are the forecast's predicted keys (the required ones, else all); with ``side_optional``
the schema's other keys get branches too, after every predicted one, so a value is ready if
MAIN writes an optional key (the packer never proposes an unpredicted key by itself); same
10 requests: 243 -> 235 target calls.
Beyond the paper (``copy_len``, 4 in ``decode=paper``, from stage B on): MAIN's tree also gets two
prompt-lookup chains (``infer/lookup.py``), the tokens after the committed text's longest
suffix (<= 3 tokens) in the prompt and in the response so far — values are mostly copied
from the request, and a 135M target's responses repeat themselves. BFCL, 10 requests, the
head of ``make run``: AL 4.40 -> 5.47, nodes per verification 17.8 -> 22.9; copying into
SIDE branches too added 3 nodes per verification for no AL (5.49), so they do not. The
response's copy runs on through its own tokens (``overlap``): a response caught in a loop is
proposed ``copy_len`` tokens ahead, not just to its end; ``decode=cost`` proposes 32 and
keeps what pays (#23's session: a 512-token loop took 108 target calls with 4, 44 with 32).
The packed chain is capped at ``max_chain`` tokens. Where each step lives: the forecast
``infer/forecast.py``, SIDE branches ``infer/side.py``, alignment ``infer/align.py``, the
packer ``infer/packer.py``, verification ``infer/session.py``; this module runs the rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from infer.align import current_call, rebind, rebind_by_keys, written_keys
from infer.candidates import Candidates
from infer.decoding import Decoded, DecoderContext, DecodeOptions
from infer.forecast import call_plan, forecast_groups, rank_tools
from infer.head_drafter import HeadDrafter, TreeBudget
from infer.packer import CLOSES, NEXT, STRUCTURE, CallPlan, continuation_ids, propose_tagged, token_kinds
from infer.phases import Phases
from infer.lookup import copy_matches
from infer.node_budget import NodeBudget
from infer.acceptance import PRIOR_STRENGTH
from infer.session import MainSession, Segment, Verified
from infer.side import SideBranches, SideContexts
from infer.tree import ROOT, chain, merge
from schemafill.config import ABLATIONS, DecodeConfig
from schemafill.response_format import JSON, ResponseFormat
from schemafill.runtime import Target
from schemafill.toolcall import ToolRequest

SIDE_DRAFT = "side_draft:1"  # the head's draft after a SIDE branch's pending token
SIDE_CHAIN = "side_"  # packed-chain sources from a SIDE value on (infer/acceptance.py)


def copy_source(kind: str, matched: int) -> str:
    """A copy's source by how many tokens before it agree with the committed text (1, 2,
    3-7, 8-15, 16+): a copy after a long agreement (a value quoted from the request, a
    response repeating itself) holds far more often than one after a lone token. A copy
    from the prompt inside a value (``copy_value``) and outside one (``copy_prompt``, where
    the prompt's schema text rarely is what comes) are learnt apart too."""
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


def build(ctx: DecoderContext, method: str) -> "SchemaFill":
    """``schemafill`` at ``decode.ablation``; ``schemafill_A`` .. ``schemafill_D`` at that stage."""
    d = ctx.decode
    cfg = SchemaFillConfig.of(d, ablation=method.partition("_")[2] or d.ablation)
    return SchemaFill(ctx.target, ctx.tokenizer, ctx.head, ctx.eos, d.max_new_tokens, cfg, ctx.budget(), ctx.fmt)


class SchemaFill:
    """One decoder instance per (target, head, tokenizer); ``decode`` per request."""

    def __init__(self, target: Target, tokenizer: Any, head: Any, eos: frozenset[int], max_new_tokens: int,
                 cfg: SchemaFillConfig, budget: NodeBudget | None = None, fmt: ResponseFormat = JSON) -> None:
        self.target, self.tokenizer, self.eos, self.cfg, self.fmt = target, tokenizer, eos, cfg, fmt
        self.max_new_tokens = max_new_tokens
        self.budget = budget or NodeBudget()
        self.drafter = HeadDrafter(head, cfg.budget, self.budget)  # the budget also prices the head's levels
        self.side_rows = self.side_credit = 0  # the launch's SIDE rows, and value tokens MAIN took from them

    def decode(self, request: ToolRequest, prompt: list[int], options: DecodeOptions = DecodeOptions(),
               groups: list[int] | None = None, values: dict[tuple[int, str], str] | None = None) -> Decoded:
        """``groups`` (catalog indices, one per call) replaces the BM25 forecast and ``values``
        ((call, key) -> value literal) pre-fills prepared values: for tests and for callers
        who know the call layout. Neither can change the output (or its distribution, with a
        sampler), only the speed."""
        cfg = self.cfg
        # initialisation (the prompt's prefill with the candidates) is kept apart, as the
        # paper's Table 5 leaves prefill out of its phases
        phases = Phases("forecast", "drafting", "verification", "other", "initialisation")
        with phases("forecast"):
            plans = self._forecast(request, groups, values)
        s = MainSession(self.target, prompt, options.response_stop(self.tokenizer, self.eos, self.max_new_tokens,
                                                                   self.fmt),
                        scratch=cfg.budget.total + 2 * cfg.max_chain + 3 * cfg.copy_len,  # head, packed chains, copies
                        side_capacity=cfg.side_capacity, sampler=options.sampler, constraint=options.constraint)
        self.drafter.start(s.layout.positions, s.layout.capacity)
        # before stage C there are no branches: the SIDE steps below do nothing
        side = SideBranches(self.tokenizer, self.eos, SideContexts(self.tokenizer, len(prompt), s.layout.side_base,
                                                                   s.layout.side_capacity, self.fmt),
                            cfg.max_branches if cfg.sides else 0, cfg.max_value_tokens, cfg.side_optional,
                            cfg.side_depth, self.fmt)
        functions = {fn["name"]: fn for fn in request.functions}

        # ---- initialisation: prompt + MAIN candidates + first SIDE prefixes, one call
        with phases("other"):
            tree = self._candidates(plans)
            extra, owners = side.open_first(plans) if self._sides_pay() else ([], [])
        with phases("initialisation"):
            v = s.prefill(*tree, extra)
        init_nodes = len(tree[0]) + sum(len(seg.tokens) for seg in extra)
        self.side_rows += sum(len(seg.tokens) for seg in extra)  # SIDE rows too: what SIDE branches cost
        side.settle(owners, v)

        round_start = time.perf_counter()
        while not s.done:
            # ---- align the plans and branches with what MAIN realized
            with phases("other"):
                text, state = s.stop.parsed_text, s.stop.parser.state
                current = current_call(state)
                if plans and state.tool_name is not None:
                    side.remap(rebind(plans, state.call_index, state.tool_name, functions))
                elif plans and state.call_index is not None and not self.fmt.name_first:
                    # the name comes after the arguments: follow the keys until it does
                    keys, typing = written_keys(text, state)
                    side.remap(rebind_by_keys(plans, state.call_index, keys, functions, typing))
                realized = {(current, k) for k, _, _ in state.spans}
                side.retire_stale(plans, current, realized)
                side.activate(plans, current, realized)
            # ---- MAIN proposal: head tree, prompt-lookup copies, packed chain (first: the head's
            # catch-up writes the prompt's head entries that SIDE drafts read)
            with phases("drafting"):
                cand = self._main_tree(s, prompt, plans, side, text, state)
            # ---- SIDE nodes: each branch's pending token and the head's draft after it
            with phases("other"):
                stepping = side.reserve_steps()
            with phases("drafting"):
                side.draft(stepping, self.drafter, s.prompt_aux)
            with phases("other"):
                extra, owners = side.segments(open_new=self._sides_pay())
            # ---- keep the MAIN nodes and SIDE steps worth their cost
            with phases("drafting"):
                cand, extra, owners = self._choose(cand, extra, owners, side, len(s.tokens) - s.n_kv)
            self.budget.host(1e3 * (time.perf_counter() - round_start))
            with phases("verification"):
                v = s.verify(cand.tokens, cand.parents, extra)
            round_start = time.perf_counter()
            self._observe(cand, v, extra, side.steps(owners))
            with phases("other"):
                side.settle(owners, v)
                side.collect(plans)
        return s.decoded(init_nodes=init_nodes, times=phases.times, head_forwards=self.drafter.forwards,
                         head_ms=round(self.drafter.ms, 3))

    def _choose(self, cand: Candidates, extra: list[Segment], owners: list, side: SideBranches, pending: int
                ) -> tuple[Candidates, list[Segment], list]:
        """The MAIN nodes and SIDE steps worth their cost this round, chosen together: MAIN's
        by their chance to be accepted, a SIDE step's rows by the launch's measured return on
        SIDE rows (tokens MAIN later accepted through packed SIDE values, per SIDE row spent),
        its head-drafted second row by how often SIDE drafts hold; MAIN's nodes alone compete
        against MAIN and SIDE together. New SIDE contexts (opened only while SIDE rows pay,
        ``_sides_pay``) always go. The current call's steps compete too: keeping them
        regardless (as before #23's second session) held every round at four rows or more,
        while on a CPU a call of up to three rows costs what one row does (10 spread BFCL450
        requests, 2-core Xeon capped to AVX2: 28.3 -> 25.9 s, 238 -> 246 target calls)."""
        steps = side.steps(owners)
        fixed = pending + sum(len(seg.tokens) for seg, step in zip(extra, steps) if not step)
        if not self.budget.active:
            return self.budget.choose(cand, fixed), extra, owners
        parents, values = list(cand.parents), self.budget.values(cand)
        worth, draft_rate = self._side_return(), self.budget.stats.rate(SIDE_DRAFT)
        first_rows = []
        for seg, step in zip(extra, steps):
            first_rows.append(len(parents) if step else None)
            if step:
                for r in range(len(seg.tokens)):
                    parents.append(ROOT if r == 0 else len(parents) - 1)
                    values.append(worth if r == 0 else worth * draft_rate)
        kept, rate = self.budget.best(parents, values, fixed, side=bool(extra))
        if any(steps) and all(steps):
            # a call without SIDE rows may cost less than its row count says (their private
            # contexts are attended apart): MAIN's nodes alone compete as a whole
            alone, solo = self.budget.best(cand.parents, values[:len(cand)], fixed, side=False)
            if solo > rate:
                kept, rate = alone, solo
        self.budget.commit(rate)
        kept = set(kept)
        main = cand.subset(sorted(i for i in kept if i < len(cand)))
        rows = [len(seg.tokens) if first is None else sum(first + r in kept for r in range(len(seg.tokens)))
                for seg, first in zip(extra, first_rows)]
        extra, owners = side.trim(extra, owners, rows)
        return main, extra, owners

    def _sides_pay(self) -> bool:
        """Do new SIDE contexts pay for their rows? Only while a SIDE row has returned at least
        what a row costs at the rate rounds promise (the curve's per-row slope): a GPU, whose
        rows are nearly free, keeps opening them; a 2-core CPU, whose rows cost ms each,
        stops once the launch has measured that they return less. Steps of open branches
        compete in selection either way."""
        if not self.budget.active or not self.budget.rate:
            return True
        return self._side_return() >= self.budget.rate * self.budget.cost.per_row

    def _side_return(self) -> float:
        """Tokens MAIN accepted from packed chains through SIDE values (the values and the
        structure after them) per SIDE row spent, from a prior of 0.5."""
        return (self.side_credit + PRIOR_STRENGTH * 0.5) / (self.side_rows + PRIOR_STRENGTH)

    def _observe(self, cand: Candidates, v: Verified, extra: list[Segment], steps: list[bool]) -> None:
        self.budget.observe(cand, v)
        self.side_rows += sum(len(seg.tokens) for seg in extra)
        self.side_credit += sum(cand.sources[i].startswith(SIDE_CHAIN) for i in v.accepted)
        for seg, step, choices in zip(extra, steps, v.extra_choices):
            if step and len(seg.tokens) == 2:  # did the target choose the head's SIDE draft?
                self.budget.stats.observe([ROOT], [SIDE_DRAFT], [0] if choices[0] == seg.tokens[1] else [])

    def _forecast(self, request: ToolRequest, groups: list[int] | None,
                  values: dict[tuple[int, str], str] | None) -> list[CallPlan]:
        """One plan per forecast call group (none at stage A), with any given values."""
        if not self.cfg.forecasts:
            return []
        if groups is None:
            groups = forecast_groups(rank_tools(request), self.cfg.forecast_budget)
        plans = [call_plan(request.functions[g]) for g in groups]
        for (j, key), literal in (values or {}).items():
            if j < len(plans):
                plans[j].values[key] = literal
        return plans

    def _candidates(self, plans: list[CallPlan]) -> tuple[list[int], list[int]]:
        """MAIN's candidates at initialisation: for each forecast tool, the canonical response
        up to its first value, merged into one tree (the greedy path picks among them)."""
        texts = [self.fmt.field_prefix(p.tool, p.keys[0]) if p.keys else self.fmt.header + self.fmt.call_header(p.tool)
                 for p in plans]  # name-last formats: the same text for tools with the same first key
        candidates = [chain(self.tokenizer(text, add_special_tokens=False).input_ids[: self.cfg.max_chain])
                      for text in dict.fromkeys(texts)]
        return merge(candidates) if candidates else ([], [])

    def _main_tree(self, s: MainSession, prompt: list[int], plans: list[CallPlan], side: SideBranches,
                   text: str, state: Any) -> Candidates:
        """The head's draft tree, merged with prompt-lookup copies and the packer's chain."""
        cfg = self.cfg
        parts = []
        if cfg.copy_len and cfg.forecasts:
            # values are mostly copied from the request, and a response repeats itself
            for source, kind, own in ((prompt, "copy_value" if state.in_value else "copy_prompt", False),
                                      (s.response, "copy_response", True)):
                # the latest occurrence's continuation, and in the response one that went another
                # way after the same text (a response alternating between two calls)
                for rank, (copied, matched) in enumerate(copy_matches(s.tokens, source, length=cfg.copy_len,
                                                                      overlap=own, most=2 if own else 1)):
                    parts.append(Candidates.chain(copied, copy_source(kind if not rank else "copy_other", matched)))
        certain = False
        if plans:
            ahead = side.provisional(plans) if cfg.pack_provisional else None
            chain, kinds = self._packed(s, text, state, plans, ahead)
            if kinds:
                parts.append(chain)
                certain = kinds[0] not in CLOSES
                if cfg.guess_ends and state.calls_started and NEXT in kinds:
                    # the chain goes on to a next call: the response may end after this one instead
                    ending, ends = self._packed(s, text, state, plans[:state.calls_started], ahead)
                    parts += [ending] if ends else []
        # beside a packed chain the head's deeper levels are rarely taken, and each costs a
        # head forward every round: there it may draft fewer levels (its catch-up runs either
        # way); a chain that starts by guessing MAIN's value ends here does not count
        depth = cfg.chain_head_depth if certain and cfg.chain_head_depth else None
        return Candidates.merged([self.drafter.candidates(s.tokens, s.new_aux, depth), *parts],
                                 self.budget.stats.rate)

    def _packed(self, s: MainSession, text: str, state: Any, plans: list[CallPlan],
                ahead: dict[tuple[int, str], str] | None) -> tuple[Candidates, list[str]]:
        """The packer's chain after MAIN's committed text, tokenised as the whole response
        would be, and each token's kind (its source tags them); no kinds when the packer has nothing."""
        cfg = self.cfg
        suffix, kinds = propose_tagged(text, state, plans, cross_calls=cfg.cross_calls, provisional=ahead,
                                       fmt=self.fmt, close=cfg.guess_ends)
        suffix = suffix.rstrip(" ")  # a lone trailing space before an unknown value would not be the target's token
        packed = continuation_ids(self.tokenizer, s.response, text, suffix, self.fmt)[: cfg.max_chain]
        if not packed:
            return Candidates(), []
        kinds = token_kinds(self.tokenizer, s.response, text, suffix, kinds[:len(suffix)], packed, self.fmt)
        # from the first value on, the chain exists only because a SIDE branch prepared it
        # (the structure, and the guessed end of MAIN's own value, are the packer's)
        first = next((i for i, k in enumerate(kinds) if k not in STRUCTURE), len(kinds))
        return Candidates.tagged_chain(packed, [f"{'side' if i >= first else 'pack'}_{k}"
                                                for i, k in enumerate(kinds)]), kinds
