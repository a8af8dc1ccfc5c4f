"""One request on the target: its KV arena (``infer/rounds/arena.py``), the committed MAIN stream,
and the target call that verifies a tree (``infer/rounds/verify.py``).

The committed response fills ``[P, n_kv)``; its newest tokens are *pending* (emitted, KV
not yet computed): the last correction, and after it any tokens the response grammar
forced. They go first in the next call, as a chain, and the last of them is the root of
the MAIN tree, which is written to the scratch rows after them.

One target call verifies the MAIN tree and any number of extra segments (SIDE branches): each
extra node names the arena slots it may see, so MAIN never sees a SIDE row, a SIDE node sees
only the prompt and its own branch, and siblings never see each other. Counters follow
docs/design.md ("Lossless, and what a request costs"): the prefill is one target call, every
verification another. At temperature > 0 the target's choice at each MAIN node is a draw from
its distribution (``Sampler``), which keeps the committed tokens distributed exactly as serial
sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.rounds.arena import ArenaLayout
from infer.rounds.call import Call, Output, Segment
from infer.rounds.commit import commit
from infer.rounds.decoding import Decoded
from infer.rounds.forward import run_alone
from infer.rounds.sampling import History, Sampler, tree_paths
from infer.rounds.tree import depths, prune
from infer.rounds.verify import chain_and_tree, choose, with_segments
from schemafill.contract.stopping import Logprob, ResponseStop
from schemafill.runtime.grammar import Constraint
from schemafill.runtime.model import Target


def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """Each token's log-probability under the target's own distribution at its row of
    ``logits`` [R, V] (the raw logits: before penalties, temperature and the grammar, as
    vLLM reports by default), with the ``top`` most likely tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if not top:
        return [(c, []) for c in chosen]
    best = lp.topk(top, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, best.indices.tolist(), best.values.tolist())]


@dataclass
class Verified:
    accepted: list[int]  # MAIN draft nodes on the accepted path, root-most first
    correction: int  # the target's own next token after them
    committed: int  # tokens that joined MAIN (≤ len(accepted) + 1 when the response stops)
    extra_choices: list[list[int]] = field(default_factory=list)  # target argmax at each deciding extra node
    extra_aux: list[torch.Tensor] = field(default_factory=list)  # [n, 3H] target features at each extra node
    # the root and the MAIN nodes the call carried (after the grammar's pruning), and the
    # target's logits at each [1 + m, V]: what token recycling learns from
    main_tokens: list[int] = field(default_factory=list)
    main_logits: torch.Tensor | None = None
    # what the target forward that carried it cost (every request's rows, in a batch): its
    # rows, how many were extra (SIDE), and its milliseconds (what selection prices)
    rows: int = 0
    extra_rows: int = 0
    ms: float = 0.0


@dataclass
class Counters:
    """What a request cost the target, counted as docs/design.md counts it."""

    target_calls: int = 0  # the prefill, then one per verification
    nodes: list[int] = field(default_factory=list)  # tree nodes (MAIN + SIDE) per verification
    peak_rows: int = 0  # most arena rows live in one call: committed + tree + SIDE (reserved spare excluded)
    forced: int = 0  # response tokens the grammar allowed alone (the ones after a verification need no target decision)
    pruned: int = 0  # draft nodes the grammar ruled out before verification
    call_rows: list[int] = field(default_factory=list)  # rows each call computed (prompt, pending, tree, SIDE)
    call_ms: list[float] = field(default_factory=list)  # and its milliseconds (what a device projection replays)

    def call(self, nodes: int, rows: int) -> None:
        """One target call that verified ``nodes`` tree nodes with ``rows`` arena rows live."""
        self.target_calls += 1
        self.nodes.append(nodes)
        self.peak_rows = max(self.peak_rows, rows)


@dataclass
class MainSession:
    target: Target
    prompt: list[int]
    stop: ResponseStop
    scratch: int = 64  # most MAIN tree nodes one verification may carry
    side_capacity: int = 0  # arena rows for SIDE branches
    sampler: Sampler | None = None  # how MAIN picks its token at each node (None: greedy)
    top_logprobs: int = 0  # alternatives kept beside each token's logprob (when ``stop`` keeps logprobs)
    constraint: Constraint | None = None  # the response grammar MAIN's choices obey, or that only prunes drafts
    tokens: list[int] = field(default_factory=list)  # prompt + committed response (last one pending)
    n_kv: int = 0  # slots holding committed KV
    counts: Counters = field(default_factory=Counters)
    # the target's features the drafters read
    new_aux: torch.Tensor | None = None  # [M, 3H] target features of the newest committed positions
    prompt_aux: torch.Tensor | None = None  # [3H] target features at the prompt's last position
    prompt_final: torch.Tensor | None = None  # [H] the target's final hidden state there (ToolSpec's retrieval key)
    _prompt_aux: list[torch.Tensor] = field(default_factory=list)  # [n, 3H] of prompt pieces prefilled so far
    _kept_aux: list[torch.Tensor] = field(default_factory=list)  # [M, 3H] each: features of every committed position

    def __post_init__(self) -> None:
        self.layout = ArenaLayout(len(self.prompt), self.stop.max_new_tokens, self.scratch, self.side_capacity)
        self.arena = self.target.new_arena(1, self.layout.capacity)
        self.device = self.target.device

    @property
    def side_base(self) -> int:
        return self.layout.side_base

    @property
    def done(self) -> bool:
        return self.stop.done

    @property
    def response(self) -> list[int]:
        return list(self.stop.ids)

    @property
    def pending(self) -> int:
        """Committed tokens whose KV the next call computes (its rows before any draft); before
        the prefill, the prompt's last token, the first tree's root (the rows before it write
        KV the prompt owes whatever is drafted)."""
        return len(self.tokens) - self.n_kv if self.tokens else 1

    def sequence(self) -> tuple[list[int], torch.Tensor]:
        """The tokens whose KV the arena holds (the prompt and the committed response but its
        pending tokens) and the target's features at each [n_kv, 3H]: what a later prompt that
        carries this conversation on may start from (``prefixes.PrefixCache``). A response cut
        at its stop inside an accepted block leaves KV past its last token: that is not held."""
        n = min(self.n_kv, len(self.tokens))
        return self.tokens[:n], torch.cat(self._kept_aux)[:n]

    def decoded(self, **extra) -> Decoded:
        """What the decoder returns: the response and this session's counters."""
        c = self.counts
        return Decoded(ids=self.response, text=self.stop.text, stop=self.stop.reason, target_calls=c.target_calls,
                       nodes=c.nodes, kv_rows=c.peak_rows, forced=c.forced, pruned=c.pruned, call_rows=c.call_rows,
                       call_ms=c.call_ms, logprobs=self.stop.logprobs, **extra)

    def release(self) -> None:
        """The arena back to the target for a later request (``ArenaStock``): call once the
        request has ended and its answer was read; the session reads no KV after it."""
        self.target.arenas.give(self.arena)

    def reuse(self, k: list[torch.Tensor], v: list[torch.Tensor], aux: torch.Tensor, n: int) -> None:
        """Start from the first ``n`` prompt tokens' KV (per layer [kv_heads, ≥n, head_dim]) and
        features (``aux`` [≥n, 3H]) computed for another request whose prompt starts the same
        (``prefixes.PrefixCache``): the prefill goes on from there."""
        if self.n_kv or not 0 < n < len(self.prompt):
            raise ValueError(f"a reused prefix must come before any prefill and leave the prompt's last token "
                             f"(n={n}, prompt {len(self.prompt)}, {self.n_kv} prefilled)")
        self.arena.load_prefix(k, v, n)
        self._prompt_aux.append(aux[:n])
        self.n_kv = n

    # ---- the calls a request makes: built here, run by ``forward.run`` (alone or packed with
    # other requests' calls), read back by ``take``
    def chunk_call(self, n: int) -> Call:
        """The prompt's next ``n`` tokens, KV only (a prefill in pieces, so a long prompt joins
        a batch without stalling it); the last prompt token always waits for ``prefill_call``."""
        p = len(self.prompt)
        n = min(n, p - 1 - self.n_kv)
        if n < 1:
            raise ValueError(f"no prompt tokens left to prefill in pieces ({self.n_kv} of {p} done)")
        a = self.n_kv
        return Call(self.arena, "chunk", self.prompt[a:a + n], list(range(a, a + n)), list(range(a, a + n)),
                    chain_and_tree(a, n, []), [], main_rows=n)

    def prefill_call(self, tree_tokens: list[int] = (), parents: list[int] = (), extra: list[Segment] = ()) -> Call:
        """The rest of the prompt, optionally with a MAIN tree hanging off its last token and
        extra segments; its result commits the greedy path and the first correction."""
        p, a = len(self.prompt), self.n_kv
        tree_tokens, parents, index, allowed = self._admit(list(tree_tokens), list(parents))
        pos = list(range(a, p)) + [p - 1 + d for d in depths(parents)]
        visible = chain_and_tree(a, p - a, parents)
        return self._call("prefill", self.prompt[a:] + tree_tokens, pos, list(range(a, p + len(tree_tokens))),
                          visible, p - 1, tree_tokens, parents, index, allowed, list(extra))

    def verify_call(self, tree_tokens: list[int], parents: list[int], extra: list[Segment] = ()) -> Call:
        """The pending tokens plus a MAIN draft tree hanging off the last of them (and extra
        segments). Pending is one token (the last correction), and more when the grammar
        forced tokens after it: they go in as a chain."""
        if len(tree_tokens) > self.scratch:
            raise ValueError(f"a tree of {len(tree_tokens)} nodes exceeds the session's scratch of {self.scratch}")
        tree_tokens, parents, index, allowed = self._admit(list(tree_tokens), list(parents))
        n, m = self.n_kv, len(tree_tokens)
        chain = self.tokens[n:]  # [L] committed, KV not yet computed; the last is the tree's root
        L = len(chain)
        pos = list(range(n, n + L)) + [n + L - 1 + d for d in depths(parents)]
        visible = chain_and_tree(n, L, parents)
        return self._call("verify", chain + tree_tokens, pos, list(range(n, n + L + m)), visible, n + L - 1,
                          tree_tokens, parents, index, allowed, list(extra))

    def prefill(self, tree_tokens: list[int] = (), parents: list[int] = (), extra: list[Segment] = ()) -> Verified:
        """``prefill_call`` run alone."""
        return self.take(*run_alone(self.target, self.prefill_call(tree_tokens, parents, extra)))

    def verify(self, tree_tokens: list[int], parents: list[int], extra: list[Segment] = ()) -> Verified:
        """``verify_call`` run alone."""
        return self.take(*run_alone(self.target, self.verify_call(tree_tokens, parents, extra)))

    def _admit(self, tree_tokens: list[int], parents: list[int]) -> tuple[list[int], list[int], list[int],
                                                                          torch.Tensor | None]:
        """Drop draft nodes the grammar forbids (and their subtrees) before they cost a row.
        Returns the kept tree, the original index of each kept node, and the allowed tokens
        [1 + m, V] after the root and after each kept node (None when unconstrained)."""
        if self.constraint is None:
            return tree_tokens, parents, list(range(len(tree_tokens))), None
        allowed, ok = self.constraint.check(tree_tokens, parents)
        index, parents = prune(parents, ok)
        self.counts.pruned += len(tree_tokens) - len(index)
        rows = None if allowed is None else allowed[[0] + [1 + i for i in index]]  # None: the target stays free
        return [tree_tokens[i] for i in index], parents, index, rows

    def _force(self) -> None:
        """Commit the tokens the grammar allows alone, with no target decision: every decoder
        would choose them, so they only cost a row in the next call (as pending tokens). Not
        where the client asked for logprobs: a token the target is not asked about has none."""
        while self.constraint is not None and not self.done and self.stop.logprobs is None:
            t = self.constraint.forced()
            if t is None or not self.stop.push([t]):
                return
            self.constraint.advance([t])
            self.tokens.append(t)
            self.counts.forced += 1

    def _call(self, kind: str, tokens: list[int], positions: list[int], slots: list[int], visible: torch.Tensor,
              root_slot: int, tree_tokens: list[int], parents: list[int], index: list[int],
              allowed: torch.Tensor | None, extra: list[Segment]) -> Call:
        """Append the extra segments; the rows whose logits are read: no token before the root
        needs them (at prefill this skips the prompt's LM head: for the built-in target, 28M
        of its 135M weights, about a fifth of the prefill), nor does a SIDE context's prefix
        before its last token, whose choice starts the value."""
        main_rows = visible.shape[0]
        mask = with_segments(visible, extra)
        for seg in extra:
            tokens = tokens + seg.tokens
            positions = positions + seg.positions
            slots = slots + seg.slots
        first = main_rows - len(tree_tokens) - 1
        at, r = list(range(first, main_rows)), main_rows
        for seg in extra:
            r += len(seg.tokens)
            at += range(r - seg.deciding, r)
        return Call(self.arena, kind, tokens, positions, slots, mask, at, root_slot, tree_tokens, parents, index, allowed,
                    extra, main_rows)

    def take(self, call: Call, out: Output) -> Verified | None:
        """Read this request's share of a target call: after a prompt piece, its KV is in; after
        a prefill or a verification, MAIN's chosen path is committed (the ``Verified``)."""
        if call.kind == "chunk":
            self._prompt_aux.append(out.aux)
            self.n_kv += len(call.tokens)
            return None
        prefill, tree_tokens, parents, extra, main_rows = \
            call.kind == "prefill", call.tree_tokens, call.parents, call.extra, call.main_rows
        logits, aux = out.logits, out.aux  # [len(at), V]: the root, MAIN's tree, the extra deciding nodes; [T, 3H]
        first = main_rows - len(tree_tokens) - 1
        rows = call.rows
        base = self.side_base
        side = {s for seg in extra for see in seg.visible for s in see if s >= base}
        self.counts.call(rows - main_rows + len(tree_tokens), max(call.slots[:main_rows]) + 1 + len(side))
        first_tree = first + 1  # index of the first MAIN tree node in this call
        # the root and MAIN's tree [1 + m, V]: each node chooses among what the grammar allows
        # after its path, greedily or by an independent draw (exact speculative sampling)
        main_n = main_rows - first
        if call.allowed is None and (self.sampler is None or self.sampler.plain):
            picked = logits.argmax(-1).tolist()  # MAIN's and SIDE's tokens in one read-back (a GPU waits for each)
            main_choice, side_choice = picked[:main_n], picked[main_n:]
        else:
            history = History(self.prompt, self.response, tree_paths(tree_tokens, parents)) \
                if self.sampler is not None and self.sampler.params.reads_history else None
            main_choice = choose(logits[:main_n], call.allowed, self.sampler, history)
            side_choice = logits[main_n:].argmax(-1).tolist()  # SIDE nodes are proposals: greedy, free
        self.counts.call_rows.append(rows)
        self.counts.call_ms.append(round(out.ms, 3))
        score = None if self.stop.logprobs is None else \
            (lambda rows, toks: logprobs(logits[rows], toks, self.top_logprobs))
        done = commit(tree_tokens, parents, main_choice, self.stop.push, call.allowed, score)
        accepted = done.accepted
        base = call.root_slot + 1  # committed MAIN continues right after the root
        self.arena.move(0, [call.slots[first_tree + i] for i in accepted], [base + j for j in range(len(accepted))])
        if self.constraint is not None:
            self.constraint.advance(done.tokens)
        self.counts.forced += done.forced
        on_path = aux[list(range(first_tree)) + [first_tree + i for i in accepted]]  # [L+A, 3H]
        if prefill:
            p = len(self.prompt)
            self.prompt_aux = aux[p - 1 - call.positions[0]]
            self.prompt_final = out.final[0]
            self.tokens = list(self.prompt) + done.tokens
            self.new_aux = torch.cat([*self._prompt_aux, on_path]) if self._prompt_aux else on_path
            self._prompt_aux = []
        else:
            self.tokens += done.tokens
            self.new_aux = on_path
        self._kept_aux.append(self.new_aux)
        self.n_kv = base + len(accepted)
        self._force()
        extra_choices, extra_aux, r, c = [], [], main_rows, 0
        for seg in extra:
            extra_choices.append(side_choice[c:c + seg.deciding])
            extra_aux.append(aux[r:r + len(seg.tokens)])
            r, c = r + len(seg.tokens), c + seg.deciding
        return Verified(accepted=[call.index[i] for i in accepted], correction=done.correction, committed=done.taken,
                        extra_choices=extra_choices, extra_aux=extra_aux, main_tokens=call.tokens[first:main_rows],
                        main_logits=logits[:main_n], rows=out.rows, extra_rows=out.extra_rows, ms=out.ms)
