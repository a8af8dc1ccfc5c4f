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

Ablations (``decode.ablation``): A = EAGLE-3 only; B = + forecast-guided initialisation and
structural packing (no prepared values), recycled copies; C = + SIDE branches, packing within a call;
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
Beyond the paper (``copy_len``, 4 by default, from stage B on): MAIN's tree also gets two
recycled chains (``infer/recycle.py``), the tokens after the committed text's longest
suffix (<= 3 tokens) in the prompt and in the response so far — values are mostly copied
from the request, and a 135M target's responses repeat themselves. BFCL, 10 requests, the
head of ``make run``: AL 4.40 -> 5.47, nodes per verification 17.8 -> 22.9; copying into
SIDE branches too added 3 nodes per verification for no AL (5.49), so they do not.
At most ``max_branches`` are active (current call first); a branch whose value passes
``max_value_tokens`` is retired unprepared; the packed chain is capped at ``max_chain``
tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infer.constraint import Constraint
from infer.decoders import Decoded
from infer.forecast import forecast_groups, predicted_keys, rank_tools
from infer.head_drafter import HeadDrafter, TreeBudget
from infer.packer import HEADER, CallPlan, call_header, dumps, propose
from infer.recycle import recycle
from infer.sampling import Sampler
from infer.session import MainSession, Segment
from infer.tree import chain, merge
from schemafill.generate import common_prefix
from schemafill.parser import parse_prefix
from schemafill.runtime import Target
from schemafill.stopping import ResponseStop
from schemafill.toolcall import ToolRequest

ABLATIONS = ("A", "B", "C", "D")
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]


@dataclass(frozen=True)
class SchemaFillConfig:
    budget: TreeBudget  # the head's MAIN tree
    forecast_budget: int = 3  # B call groups
    ablation: str = "D"
    side_depth: int = 1
    pack_provisional: bool = True  # pack a value's unclosed SIDE prefix too
    side_optional: bool = True  # branches for the schema keys the forecast did not predict, last
    copy_len: int = 4  # MAIN chains recycled from the prompt and from the response, at most this long; 0 = off
    max_branches: int = 8
    max_value_tokens: int = 48
    max_chain: int = 48

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise ValueError(f"decode.ablation must be one of {ABLATIONS}, got {self.ablation!r}")
        if self.side_depth not in (0, 1):
            raise ValueError(f"decode.side_depth must be 0 (SIDE branches advance by the target's token) or 1 "
                             f"(plus one head-drafted token per round, the paper's), got {self.side_depth}")


@dataclass
class Branch:
    call: int
    tool: str
    field: str
    hint: str  # ordinal hint of the call position it was opened for (kept if the plan is rebound)
    header: str  # the canonical call text after the hint, up to the field's colon
    trunk: "Trunk | None" = None  # the prefix it shares with sibling branches (None: all its own)
    tokens: list[int] = field(default_factory=list)  # its own tokens with target KV, after the trunk's
    slots: list[int] = field(default_factory=list)  # their arena rows
    aux: list[Any] = field(default_factory=list)  # their target features ([3H] each), for the head
    value: list[int] = field(default_factory=list)  # value tokens generated so far (a suffix of tokens)
    pending: int | None = None  # the target's next token for it, KV not yet computed
    draft: int | None = None  # the head's guess at the token after ``pending`` (side_depth 1)
    reserved: list[int] = field(default_factory=list)  # rows for pending (and draft) in the next call
    head_done: int = 0  # own tokens whose head KV exists (pending's counts once it is computed)


def ordinal_hint(call: int) -> str:
    if call == 0:
        return ""
    word = ORDINALS[call] if call < len(ORDINALS) else f"number {call + 1}"
    return f"Select the {word} request.\n"


def continuation_ids(tokenizer: Any, committed: list[int], text: str, suffix: str) -> list[int]:
    """Tokens for ``suffix`` after ``committed`` (whose text the packer saw as ``text``) as the
    whole response would be tokenised (BPE merges across the boundary), falling back to
    the suffix alone; nothing while the parsed text lags (a split multi-byte character)."""
    if not suffix or tokenizer.decode(committed, skip_special_tokens=True) != text:
        return []
    full = tokenizer(text + suffix, add_special_tokens=False).input_ids
    if full[: len(committed)] == committed and len(full) > len(committed):
        return full[len(committed):]
    return tokenizer(suffix, add_special_tokens=False).input_ids


class SlotPool:
    """Free SIDE rows of the arena (lowest first, so the attended span stays short)."""

    def __init__(self, base: int, size: int) -> None:
        self.free = list(range(base + size - 1, base - 1, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        self.free.extend(reversed(slots))


@dataclass
class Trunk:
    ids: list[int]  # tokens every branch on it starts with
    slots: list[int]
    branches: int = 0
    aux: list[Any] = field(default_factory=list)  # target features of its tokens, once verified
    head_done: int = 0


class SideContexts:
    """The SIDE part of the arena: slots, and trunks shared by sibling branches.

    A branch's private context is ``hint + header`` tokenised as one piece. Its siblings
    (same call, other fields) share ``hint + call header``; that shared part is computed
    once, as a trunk every sibling sees, and each branch adds only its own tokens — the
    paper's "shared nodes count once per verification". Only the tokens the full and the
    shared text tokenise alike are shared (BPE may merge across the boundary), so every
    branch still sees exactly its own tokenisation.

    With ``side_depth`` 1 the EAGLE-3 head drafts one token after each branch's pending
    one. Its KV for a SIDE context lives in the head's arena at the *target* slot of the
    token it pairs with (the head's entry for position q pairs token q+1 with the target's
    features at q), so trunk entries are shared like the trunk and freeing a row frees
    both; it sees the head's prompt entries [0, P-1) — the entry at P-1 is MAIN's own.
    """

    def __init__(self, tokenizer: Any, prompt_len: int, base: int, size: int) -> None:
        self.tokenizer, self.p = tokenizer, prompt_len
        self.pool = SlotPool(base, size)
        self.trunks: dict[tuple[int, ...], Trunk] = {}

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---------------------------------------------------------------- target nodes
    def open(self, b: Branch) -> list[Segment] | None:
        """Segments that compute ``b``'s context (a new trunk first, if one is needed); None
        when the pool is full (try again next round)."""
        ids = self._ids(b.hint + b.header)
        shared = common_prefix(ids, self._ids(b.hint + HEADER + call_header(b.tool)))
        shared = min(shared, len(ids) - 1)  # the branch keeps at least its last token: its choice is the value's start
        segments = []
        key = tuple(ids[:shared])
        trunk = self.trunks.get(key) if shared else None
        if trunk is None and shared:
            slots = self.pool.take(shared)
            if slots is None:
                return None
            trunk = self.trunks[key] = Trunk(list(key), slots)
            segments.append(self._segment(list(key), 0, [], slots))
        own = ids[shared:]
        slots = self.pool.take(len(own))
        if slots is None:
            if trunk is not None and not trunk.branches:
                self._drop(trunk)
            return None
        if trunk is not None:
            trunk.branches += 1
        b.trunk, b.tokens, b.slots = trunk, own, slots
        segments.append(self._segment(own, shared, trunk.slots if trunk else [], slots))
        return segments

    def reserve(self, b: Branch, depth: int) -> bool:
        """Rows for the pending token (and a draft when ``depth`` is 1) of the next call."""
        slots = self.pool.take(1 + depth)
        if slots is None:
            return False
        b.reserved = slots
        return True

    def step(self, b: Branch) -> Segment:
        """The pending token (and the head's draft after it) as a chain of nodes."""
        context = list(range(self.p)) + self._slots(b)
        tokens = [b.pending] + ([b.draft] if len(b.reserved) == 2 else [])
        first = len(context)  # the prompt's P positions, then the branch's context
        return Segment(tokens=tokens, positions=list(range(first, first + len(tokens))), slots=list(b.reserved),
                       visible=[context + b.reserved[: i + 1] for i in range(len(tokens))])

    def settle(self, b: Branch | Trunk, choices: list[int], aux: Any) -> None:
        """Record a verified segment: a trunk's or prefix's features, or a step's outcome —
        the pending token joins the branch, the draft too when the target chose it."""
        if isinstance(b, Trunk):
            b.aux = list(aux)
            return
        if not b.reserved:  # its prefix
            b.aux = list(aux)
            b.pending = choices[-1]
            return
        b.tokens.append(b.pending)
        b.value.append(b.pending)
        b.slots.append(b.reserved[0])
        b.aux.append(aux[0])
        b.pending = choices[0]
        if len(b.reserved) == 2:
            if choices[0] == b.draft:
                b.tokens.append(b.draft)
                b.value.append(b.draft)
                b.slots.append(b.reserved[1])
                b.aux.append(aux[1])
                b.pending = choices[1]
            else:
                self.pool.give(b.reserved[1:])
        b.reserved, b.draft = [], None

    def free(self, b: Branch) -> None:
        self.pool.give(b.slots + b.reserved)
        b.slots, b.reserved = [], []
        if b.trunk is not None:
            b.trunk.branches -= 1
            if not b.trunk.branches:
                self._drop(b.trunk)
            b.trunk = None

    # ---------------------------------------------------------------- head entries
    def head_entries(self, branches: list[Branch], prompt_aux: Any) -> tuple[list, list[int]]:
        """The head entries still missing for ``branches`` (each with rows reserved for its
        pending token): trunks first, then each branch's own tokens and its pending token.
        Returns (tokens, aux, positions, slots, visible) lists and, per branch, the index of
        its pending entry — the one whose output drafts."""
        tokens, aux, positions, slots, visible, want = [], [], [], [], [], []
        prompt = list(range(self.p - 1))

        def add(token: int, feature: Any, index: int, slot: int, seen: list[int]) -> None:
            tokens.append(token)
            aux.append(feature)
            positions.append(self.p + index - 1)
            slots.append(slot)
            visible.append(prompt + seen)

        for b in branches:
            t = b.trunk
            base = t.slots if t else []
            feats = [prompt_aux] + (t.aux if t else []) + b.aux  # feats[i]: features at position P+i-1
            if t is not None and t.head_done < len(t.ids):
                for i in range(t.head_done, len(t.ids)):
                    add(t.ids[i], feats[i], i, t.slots[i], t.slots[: i + 1])
                t.head_done = len(t.ids)
            for j in range(b.head_done, len(b.tokens)):
                i = len(base) + j
                add(b.tokens[j], feats[i], i, b.slots[j], base + b.slots[: j + 1])
            i = len(base) + len(b.tokens)
            want.append(len(tokens))
            add(b.pending, feats[i], i, b.reserved[0], base + b.slots + b.reserved[:1])
            b.head_done = len(b.tokens) + 1  # the pending token joins ``tokens`` when it is verified
        return [tokens, aux, positions, slots, visible], want

    def _slots(self, b: Branch) -> list[int]:
        return (b.trunk.slots if b.trunk else []) + b.slots

    def _drop(self, trunk: Trunk) -> None:
        self.pool.give(trunk.slots)
        del self.trunks[tuple(trunk.ids)]

    def _segment(self, tokens: list[int], offset: int, seen: list[int], slots: list[int]) -> Segment:
        """Causal nodes at positions P+offset.. that see the prompt, ``seen`` and each other."""
        context = list(range(self.p)) + seen
        return Segment(tokens=tokens, positions=list(range(self.p + offset, self.p + offset + len(tokens))),
                       slots=slots, visible=[context + slots[: i + 1] for i in range(len(tokens))])


class SchemaFill:
    """One decoder instance per (target, head, tokenizer); ``decode`` per request."""

    def __init__(self, target: Target, tokenizer: Any, head: Any, eos: frozenset[int], max_new_tokens: int,
                 cfg: SchemaFillConfig) -> None:
        self.target, self.tokenizer, self.eos, self.cfg = target, tokenizer, eos, cfg
        self.max_new_tokens = max_new_tokens
        self.drafter = HeadDrafter(head, cfg.budget)

    # ------------------------------------------------------------------ per request
    def decode(self, request: ToolRequest, prompt: list[int], groups: list[int] | None = None,
               values: dict[tuple[int, str], str] | None = None, sampler: Sampler | None = None,
               constraint: Constraint | None = None) -> Decoded:
        """``groups`` (catalog indices, one per call) replaces the BM25 forecast and ``values``
        ((call, key) -> value literal) pre-fills prepared values: for tests and for callers
        who know the call layout. Neither can change the output (or its distribution, with a
        ``sampler``), only the speed."""
        cfg, tok = self.cfg, self.tokenizer
        # initialisation (the prompt's prefill with the candidates) is kept apart, as the
        # paper's Table 5 leaves prefill out of its phases
        times = {"forecast": 0.0, "drafting": 0.0, "verification": 0.0, "other": 0.0, "initialisation": 0.0}
        t = time.perf_counter()
        functions = {fn["name"]: fn for fn in request.functions}
        plans: list[CallPlan] = []
        if cfg.ablation != "A":
            if groups is None:
                groups = forecast_groups(rank_tools(request), cfg.forecast_budget)
            plans = [self._plan(request.functions[g]) for g in groups]
            for (j, key), literal in (values or {}).items():
                if j < len(plans):
                    plans[j].values[key] = literal
        times["forecast"] += time.perf_counter() - t

        side = cfg.ablation in ("C", "D")
        capacity = (cfg.max_branches * (64 + cfg.max_value_tokens)) if side else 0
        s = MainSession(self.target, prompt, ResponseStop(tok, self.eos, self.max_new_tokens),
                        scratch=cfg.budget.total + cfg.max_chain + 2 * cfg.copy_len,
                        side_capacity=capacity, sampler=sampler, constraint=constraint)
        contexts = SideContexts(tok, len(prompt), s.side_base, capacity)
        self.drafter.start(len(prompt) + self.max_new_tokens + 1, s.side_base + capacity)
        branches: list[Branch] = []
        prepared_keys: set[tuple[int, str]] = set()  # (call, field) whose value was prepared or retired

        # ---- initialisation: prompt + MAIN candidates + first SIDE prefixes, one call
        t = time.perf_counter()
        candidates = []
        for plan in {p.tool: p for p in plans}.values():
            text = HEADER + call_header(plan.tool) + (dumps(plan.keys[0]) + ":" if plan.keys else "")
            candidates.append(chain(tok(text, add_special_tokens=False).input_ids[: cfg.max_chain]))
        tree = merge(candidates) if candidates else ([], [])
        extra, owners = [], []
        if side:
            branches = self._activate(branches, plans, 0, prepared_keys, set())
            branches = [b for b in branches if self._add(contexts.open(b), b, extra, owners)]
        times["other"] += time.perf_counter() - t
        t = time.perf_counter()
        v = s.prefill(tree[0], tree[1], extra)
        times["initialisation"] += time.perf_counter() - t
        init_nodes = len(tree[0]) + sum(len(seg.tokens) for seg in extra)
        for owner, choices, aux in zip(owners, v.extra_choices, v.extra_aux):
            contexts.settle(owner, choices, aux)

        while not s.done:
            # ---- align the plans and branches with what MAIN realized
            t = time.perf_counter()
            text, state = s.stop.parsed_text, s.stop.parser.state
            current = state.call_index if state.call_index is not None else state.calls_started
            if plans and state.tool_name is not None:
                self._rebind(plans, branches, state.call_index, state.tool_name, functions)
            realized = {(current, k) for k, _, _ in state.spans}
            if side:
                kept = []
                for b in branches:
                    stale = b.call < current or (b.call, b.field) in realized or b.call >= len(plans) \
                        or plans[b.call].tool != b.tool
                    if stale:
                        contexts.free(b)
                        prepared_keys.add((b.call, b.field))
                    else:
                        kept.append(b)
                branches = self._activate(kept, plans, current, prepared_keys, realized)
            times["other"] += time.perf_counter() - t

            # ---- MAIN proposal: head tree + packed chain
            t = time.perf_counter()
            tokens, parents = self.drafter.draft(s.tokens, s.new_aux)
            if cfg.copy_len and cfg.ablation != "A":
                # values are mostly copied from the request, and a response repeats itself
                copies = [chain(recycle(s.tokens, source, length=cfg.copy_len)) for source in (prompt, s.response)]
                tokens, parents = merge([(tokens, parents), *copies])
            if plans:
                ahead = self._provisional(branches, plans) if side and cfg.pack_provisional else None
                # a lone trailing space before an unknown value would not be the target's token
                suffix = propose(text, state, plans, cross_calls=cfg.ablation == "D", provisional=ahead).rstrip(" ")
                packed = continuation_ids(tok, s.response, text, suffix)[: cfg.max_chain]
                if packed:
                    tokens, parents = merge([(tokens, parents), chain(packed)])
            times["drafting"] += time.perf_counter() - t

            # ---- SIDE nodes: new prefixes, then each branch's pending token (and the head's
            # draft after it); a branch the pool has no room for tries again next round
            t = time.perf_counter()
            extra, owners = [], []
            stepping = [b for b in branches if b.pending is not None and contexts.reserve(b, cfg.side_depth)]
            if stepping and cfg.side_depth:
                t_draft = time.perf_counter()
                entries, want = contexts.head_entries(stepping, s.prompt_aux)
                for b, d in zip(stepping, self.drafter.top1(self.drafter.entries(*entries, want))):
                    b.draft = d
                times["drafting"] += time.perf_counter() - t_draft
                t += time.perf_counter() - t_draft
            for b in branches:
                if b.pending is None:
                    self._add(contexts.open(b), b, extra, owners)
                elif b.reserved:
                    self._add([contexts.step(b)], b, extra, owners)
            times["other"] += time.perf_counter() - t

            t = time.perf_counter()
            v = s.verify(tokens, parents, extra)
            times["verification"] += time.perf_counter() - t

            t = time.perf_counter()
            for owner, choices, aux in zip(owners, v.extra_choices, v.extra_aux):
                contexts.settle(owner, choices, aux)
            if side:
                branches = self._collect(branches, plans, contexts, prepared_keys)
            times["other"] += time.perf_counter() - t

        return s.decoded(init_nodes=init_nodes, times=times)

    # ------------------------------------------------------------------ plans
    @staticmethod
    def _plan(fn: dict) -> CallPlan:
        props = (fn.get("parameters") or {}).get("properties") or {}
        return CallPlan(fn["name"], tuple(predicted_keys(fn)), tuple(props), {})

    def _rebind(self, plans: list[CallPlan], branches: list[Branch], j: int, tool: str, functions: dict) -> None:
        """Make plans[j] a plan for the realized ``tool``: swap in a later (unused) group with
        that tool, whose branches and prepared values follow it, else a fresh plan. An
        unknown tool leaves the plan alone (the packer then proposes nothing for the call)."""
        if (j < len(plans) and plans[j].tool == tool) or tool not in functions:
            return
        if j >= len(plans):  # more calls than forecast groups
            plans.extend(self._plan(functions[tool]) for _ in range(j + 1 - len(plans)))
            return
        later = next((g for g in range(j + 1, len(plans)) if plans[g].tool == tool), None)
        if later is None:
            plans[j] = self._plan(functions[tool])
            return
        plans[j], plans[later] = plans[later], plans[j]
        for b in branches:
            if b.call in (j, later):
                b.call = later if b.call == j else j

    # ------------------------------------------------------------------ SIDE branches
    def _activate(self, branches: list[Branch], plans: list[CallPlan], current: int,
                  done: set[tuple[int, str]], realized: set[tuple[int, str]]) -> list[Branch]:
        """Keep branches for the current and next call; open new ones up to the cap."""
        have = {(b.call, b.field) for b in branches}
        calls = [j for j in (current, current + 1) if j < len(plans)]
        # predicted keys first; then the schema's other keys, whose values MAIN uses only
        # if it writes the key (the packer never proposes an unpredicted key by itself)
        slots = [(j, k) for j in calls for k in plans[j].keys]
        if self.cfg.side_optional:
            slots += [(j, k) for j in calls for k in plans[j].schema_keys if k not in plans[j].keys]
        for j, key in slots:
            if len(branches) >= self.cfg.max_branches:
                return branches
            if (j, key) in have or (j, key) in done or (j, key) in realized or key in plans[j].values:
                continue
            header = HEADER + call_header(plans[j].tool) + dumps(key) + ":"
            branches.append(Branch(call=j, tool=plans[j].tool, field=key, hint=ordinal_hint(j), header=header))
            have.add((j, key))
        return branches

    @staticmethod
    def _add(segments: list[Segment] | None, b: Branch, extra: list[Segment],
             owners: list[Branch | Trunk]) -> bool:
        """Queue a branch's segments for the next target call: a new trunk's, then its own."""
        if not segments:
            return False
        extra += segments
        owners += [b.trunk] * (len(segments) - 1) + [b]
        return True

    def _provisional(self, branches: list[Branch], plans: list[CallPlan]) -> dict[tuple[int, str], str]:
        """(call, key) -> the unclosed value its branch has so far (the pending token included:
        it is the target's own choice in that context)."""
        ahead = {}
        for b in branches:
            if b.call < len(plans) and plans[b.call].tool == b.tool and b.value:
                ids = b.value + ([b.pending] if b.pending is not None and b.pending not in self.eos else [])
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if text.startswith(" ") and text.strip():  # the packer writes the space after the colon
                    ahead[(b.call, b.field)] = text[1:]
        return ahead

    def _collect(self, branches: list[Branch], plans: list[CallPlan], contexts: SideContexts,
                 done: set[tuple[int, str]]) -> list[Branch]:
        """Branches whose value literal closed hand it to their plan and are freed."""
        kept = []
        for b in branches:
            literal = None
            if b.value:
                text = b.header + self.tokenizer.decode(b.value, skip_special_tokens=True)
                state = parse_prefix(text)
                span = next(((a, e) for k, a, e in state.spans if k == b.field), None)
                if span is not None:
                    literal = text[span[0]:span[1]]
                elif state.error is not None or len(b.value) >= self.cfg.max_value_tokens or b.pending in self.eos:
                    contexts.free(b)
                    done.add((b.call, b.field))
                    continue
            if literal is not None:
                if b.call < len(plans) and plans[b.call].tool == b.tool:
                    plans[b.call].values[b.field] = literal
                contexts.free(b)
                done.add((b.call, b.field))
                continue
            kept.append(b)
        return kept
