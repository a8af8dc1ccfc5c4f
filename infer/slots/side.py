"""SIDE branches (paper §4.3; docs/design.md, "SchemaFill, step by step": SIDE branches): the slots
being prepared, their private contexts in the arena's SIDE rows, and what they hand to the
packer.

A SIDE branch for slot (call j, field f of tool t) sees the prompt, an ordinal hint for
j ≥ 2 ("Select the second request.") and the canonical text a call of t has up to f's
colon, tokenised as one piece like MAIN's response. Each round it contributes its pending
token (the target's previous choice for it) and, with ``side_depth`` 1, the head's top-1
draft after it; the target's choice there is its next token, under the branch's own
context only. A value is *prepared* when its literal closes; it is then offered to the
packer and the branch is freed. Nothing of a branch is ever emitted or moved into MAIN.
In a format that writes a call's name after its arguments (``hermes3``) the context ends
before any name: it is the same text for every tool, so siblings of all tools share one
trunk, and a branch stays with its call when the plan is rebound to another tool with its
key (in name-first formats its context names the tool, and it retires).
Parallel Fill generates its values under the same private contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator

from infer.rounds.call import Segment
from infer.rounds.session import Verified
from infer.slots.align import is_stale, slots_to_open
from infer.slots.packer import CallPlan
from schemafill.contract.parser import parse_prefix
from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.runtime.generation import common_prefix

ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]


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

    def __init__(self, tokenizer: Any, prompt_len: int, base: int, size: int, fmt: ResponseFormat = JSON) -> None:
        self.tokenizer, self.p, self.fmt = tokenizer, prompt_len, fmt
        self.pool = SlotPool(base, size)
        self.trunks: dict[tuple[int, ...], Trunk] = {}

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---------------------------------------------------------------- target nodes
    def open(self, b: Branch) -> list[Segment] | None:
        """Segments that compute ``b``'s context (a new trunk first, if one is needed); None
        when the pool is full (try again next round)."""
        ids = self._ids(b.hint + b.header)
        shared = common_prefix(ids, self._ids(b.hint + self.fmt.header + self.fmt.call_header(b.tool)))
        shared = min(shared, len(ids) - 1)  # the branch keeps at least its last token: its choice is the value's start
        segments = []
        key = tuple(ids[:shared])
        trunk = self.trunks.get(key) if shared else None
        if trunk is None and shared:
            slots = self.pool.take(shared)
            if slots is None:
                return None
            trunk = self.trunks[key] = Trunk(list(key), slots)
            segments.append(self._segment(list(key), 0, [], slots, decides=0))  # only its features are read
        own = ids[shared:]
        slots = self.pool.take(len(own))
        if slots is None:
            if trunk is not None and not trunk.branches:
                self._drop(trunk)
            return None
        if trunk is not None:
            trunk.branches += 1
        b.trunk, b.tokens, b.slots = trunk, own, slots
        segments.append(self._segment(own, shared, trunk.slots if trunk else [], slots, decides=1))  # the value's start
        return segments

    def reserve(self, b: Branch, depth: int) -> bool:
        """Rows for the pending token (and a draft when ``depth`` is 1) of the next call."""
        slots = self.pool.take(1 + depth)
        if slots is None:
            return False
        b.reserved = slots
        return True

    def unreserve(self, b: Branch, keep: int) -> None:
        """Give back the reserved rows past the first ``keep`` (the draft's, or all: the step
        waits a round, and its pending token's head entry is written again then)."""
        self.pool.give(b.reserved[keep:])
        b.reserved, b.draft = b.reserved[:keep], None
        if not keep:
            b.head_done = len(b.tokens)

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

    def _segment(self, tokens: list[int], offset: int, seen: list[int], slots: list[int],
                 decides: int | None = None) -> Segment:
        """Causal nodes at positions P+offset.. that see the prompt, ``seen`` and each other;
        the target's choice is read at the last ``decides`` of them (None: all)."""
        context = list(range(self.p)) + seen
        return Segment(tokens=tokens, positions=list(range(self.p + offset, self.p + offset + len(tokens))),
                       slots=slots, visible=[context + slots[: i + 1] for i in range(len(tokens))], decides=decides)


class SideBranches:
    """One request's SIDE branches: which slots have one, their rows (``SideContexts``), and
    the slots already prepared or given up (never reopened).

    At most ``max_branches`` are active (current call first); a branch whose value passes
    ``max_value_tokens`` is retired unprepared."""

    def __init__(self, tokenizer: Any, eos: frozenset[int], contexts: SideContexts, max_branches: int,
                 max_value_tokens: int, optional: bool, depth: int, fmt: ResponseFormat = JSON) -> None:
        self.tokenizer, self.eos, self.contexts, self.fmt = tokenizer, eos, contexts, fmt
        self.max_branches, self.max_value_tokens, self.optional, self.depth = \
            max_branches, max_value_tokens, optional, depth
        self.branches: list[Branch] = []
        self.done: set[tuple[int, str]] = set()  # (call, field) whose value was prepared or retired

    def remap(self, moves: dict[int, int]) -> None:
        """Branches follow their plan when ``align.rebind`` swapped it to another call."""
        for b in self.branches:
            b.call = moves.get(b.call, b.call)

    def retire_stale(self, plans: list[CallPlan], current: int, realized: set[tuple[int, str]]) -> None:
        kept = []
        for b in self.branches:
            if b.call < len(plans) and plans[b.call].tool != b.tool and b.field in plans[b.call].schema_keys \
                    and self.fmt.field_prefix(plans[b.call].tool, b.field) == b.header:
                b.tool = plans[b.call].tool  # a name-last format: the same context prepares the new plan's value
            if is_stale(b.call, b.tool, b.field, current, realized, plans):
                self.contexts.free(b)
                self.done.add((b.call, b.field))
            else:
                kept.append(b)
        self.branches = kept

    def activate(self, plans: list[CallPlan], current: int, realized: set[tuple[int, str]]) -> None:
        """Open branches for the current and next call's slots, up to the cap."""
        if len(self.branches) >= self.max_branches:  # always, before stage C: nothing to build each round
            return
        have = {(b.call, b.field) for b in self.branches}
        for j, key in slots_to_open(plans, current, self.optional):
            if len(self.branches) >= self.max_branches:
                return
            if (j, key) in have or (j, key) in self.done or (j, key) in realized or key in plans[j].values:
                continue
            self.branches.append(Branch(call=j, tool=plans[j].tool, field=key, hint=ordinal_hint(j),
                                        header=self.fmt.field_prefix(plans[j].tool, key)))
            have.add((j, key))

    def open_first(self, plans: list[CallPlan]) -> tuple[list[Segment], list[Branch | Trunk]]:
        """The first branches' prefixes, for the prompt's prefill; one the pool has no room
        for is dropped."""
        self.activate(plans, 0, set())
        extra: list[Segment] = []
        owners: list[Branch | Trunk] = []
        self.branches = [b for b in self.branches if _queue(self.contexts.open(b), b, extra, owners)]
        return extra, owners

    def reserve_steps(self) -> list[Branch]:
        """Branches with a pending token that got rows for their next step."""
        return [b for b in self.branches if b.pending is not None and self.contexts.reserve(b, self.depth)]

    def draft(self, stepping: list[Branch], drafter: Any, prompt_aux: Any) -> Generator[Any, Any, None]:
        """The head's top-1 draft after each stepping branch's pending token (``side_depth`` 1);
        yields the head forward it takes (``proposers/head.HeadStep``)."""
        if stepping and self.depth:
            entries, want = self.contexts.head_entries(stepping, prompt_aux)
            for b, d in zip(stepping, (yield from drafter.entry_steps(*entries, want))):
                b.draft = d

    def segments(self, open_new: bool = True) -> tuple[list[Segment], list[Branch | Trunk]]:
        """This round's SIDE nodes: new prefixes (unless ``open_new`` is off: they wait), then
        each reserved step; a branch the pool has no room for tries again next round.
        ``owners[i]`` settles segment i."""
        extra: list[Segment] = []
        owners: list[Branch | Trunk] = []
        for b in self.branches:
            if b.pending is None:
                if open_new:
                    _queue(self.contexts.open(b), b, extra, owners)
            elif b.reserved:
                _queue([self.contexts.step(b)], b, extra, owners)
        return extra, owners

    def steps(self, owners: list[Branch | Trunk]) -> list[bool]:
        """Which of this round's segments are steps (a branch's pending token and draft), the
        ones a cost-aware round may trim; the rest compute new contexts."""
        return [isinstance(o, Branch) and bool(o.reserved) for o in owners]

    def trim(self, extra: list[Segment], owners: list[Branch | Trunk], rows: list[int]
             ) -> tuple[list[Segment], list[Branch | Trunk]]:
        """Keep the first ``rows[i]`` rows of step segment i (0 drops the step this round: its
        rows go back to the pool and its head entry is redone next round)."""
        kept_extra, kept_owners = [], []
        for seg, owner, n in zip(extra, owners, rows):
            if n < len(seg.tokens):
                self.contexts.unreserve(owner, n)
                if not n:
                    continue
                seg = Segment(seg.tokens[:n], seg.positions[:n], seg.slots[:n], seg.visible[:n])
            kept_extra.append(seg)
            kept_owners.append(owner)
        return kept_extra, kept_owners

    def settle(self, owners: list[Branch | Trunk], verified: Verified) -> None:
        for owner, choices, aux in zip(owners, verified.extra_choices, verified.extra_aux):
            self.contexts.settle(owner, choices, aux)

    def provisional(self, plans: list[CallPlan]) -> dict[tuple[int, str], str]:
        """(call, key) -> the unclosed value its branch has so far (the pending token included:
        it is the target's own choice in that context)."""
        ahead = {}
        for b in self.branches:
            if b.call < len(plans) and plans[b.call].tool == b.tool and b.value:
                ids = b.value + ([b.pending] if b.pending is not None and b.pending not in self.eos else [])
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if text.startswith(" ") and text.strip():  # the packer writes the space after the colon
                    ahead[(b.call, b.field)] = text[1:]
        return ahead

    def collect(self, plans: list[CallPlan]) -> None:
        """Branches whose value literal closed hand it to their plan and are freed."""
        kept = []
        for b in self.branches:
            literal = None
            if b.value:
                text = b.header + self.tokenizer.decode(b.value, skip_special_tokens=True)
                state = parse_prefix(text, self.fmt)
                span = next(((a, e) for k, a, e in state.spans if k == b.field), None)
                if span is not None:
                    literal = text[span[0]:span[1]]
                elif state.error is not None or len(b.value) >= self.max_value_tokens or b.pending in self.eos:
                    self.contexts.free(b)
                    self.done.add((b.call, b.field))
                    continue
            if literal is not None:
                if b.call < len(plans) and plans[b.call].tool == b.tool:
                    plans[b.call].values[b.field] = literal
                self.contexts.free(b)
                self.done.add((b.call, b.field))
                continue
            kept.append(b)
        self.branches = kept


def _queue(segments: list[Segment] | None, b: Branch, extra: list[Segment], owners: list[Branch | Trunk]) -> bool:
    """Queue a branch's segments for the next target call: a new trunk's, then its own."""
    if not segments:
        return False
    extra += segments
    owners += [b.trunk] * (len(segments) - 1) + [b]
    return True
