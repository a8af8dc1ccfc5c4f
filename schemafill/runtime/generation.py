"""Batched greedy generation on the runtime, under the shared stopping rule.

Used where throughput over many requests matters more than per-request latency: the
target's continuations of the training pool and quality checks. Timed, per-request
decoding for evaluation belongs to the decoders, not here.

Three things make it fast on a CPU, where every forward costs the same whatever is
wasted inside it:

* **Continuous batching.** Each arena row holds one request; a row that stops is refilled
  with the next request at once, so a long response never idles the other rows and the
  batch never runs half empty except at the very end.
* **No padding.** Rows start at slot 0 and each token sees only its own row's slots, so a
  row's positions and masks are exactly those of a batch-1 run.
* **Shared prompt prefixes.** Tool-calling prompts share long prefixes (instructions,
  catalogs); given prompts in sorted order (``prefix_order``), a new request reuses the KV
  of the previous request's common prefix (copied between rows, or kept in place when
  it takes over that very row) and prefills only the rest. On the BFCL training pool this
  skips about half of all prompt tokens.

Under a grammar (``constrain``: structured outputs) each token is the target's greedy choice
among the tokens the grammar allows, and a generation also keeps the target's own greedy
token at each position (``Generation.greedy``): where they differ the grammar chose, and a
head learns the target's choices, not the grammar's.

With ``capture=True`` each generation also carries the target's features of its own tokens
(aux hidden states, final hidden state, argmax: what an EAGLE-3 head trains on), taken from
the forwards that produced it, so nobody has to run the target over the rows again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from schemafill.contract.response_format import JSON, ResponseFormat
from schemafill.contract.stopping import ResponseStop, eos_token_ids
from schemafill.runtime.calls import causal_visibility
from schemafill.runtime.model import Target


@dataclass(frozen=True)
class Generation:
    ids: list[int]  # response token ids (EOS included when it ended the response)
    text: str  # response text, special tokens skipped
    stop: str  # closed | eos | length
    prefilled: int = 0  # prompt tokens computed for it (the rest came from a shared prefix)
    # with capture (fp16, CPU): aux of positions 0..L-2 (the last token was never fed back),
    # final of positions P-1..L-2 (P prompt, L prompt + response tokens); their argmax is ids
    aux: torch.Tensor | None = None  # [L-1, 3·H]
    final: torch.Tensor | None = None  # [L-P, H]
    # under a grammar: the target's own greedy token at each response position (ids differ where the grammar chose)
    greedy: list[int] | None = None


@dataclass
class _Row:
    index: int  # which prompt
    length: int  # arena slots filled
    pending: int  # the newest token: emitted, not yet in the arena
    stop: Any  # ResponseStop or a caller's rule with its interface
    prefilled: int
    aux: list[torch.Tensor] | None = None  # captured chunks, [n, 3·H] each
    final: list[torch.Tensor] | None = None  # [n, H] each
    constraint: Any = None  # the grammar its tokens are chosen under (``grammar.Constraint``), or None
    greedy: list[int] | None = None


def prefix_order(prompts: list[list[int]]) -> list[int]:
    """Indices of ``prompts`` in lexicographic order: neighbours share the longest prefixes."""
    return sorted(range(len(prompts)), key=lambda i: prompts[i])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def generate(target: Target, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             eos: frozenset[int] | None = None,
             on_done: Callable[[int, Generation], None] | None = None,
             make_stop: Callable[[int], Any] | None = None, capture: bool = False,
             fmt: ResponseFormat = JSON, admit: Callable[[int], bool] | None = None,
             constrain: Callable[[int], Any] | None = None) -> list[Generation | None]:
    """Greedy responses for every prompt (admitted in the given order), returned in input
    order; ``on_done(index, generation)`` is called as each one finishes. ``make_stop(index)``
    replaces the response stopping rule with another object of ``ResponseStop``'s interface
    (``push``, ``done``, ``ids``, ``text``, ``reason``); by default responses stop as ``fmt``'s
    do. ``capture`` keeps each token's
    features (``Generation.aux``, ``.final``); with ``on_done`` only the callback sees them.
    ``admit(index)`` False stops admissions there: the rows under way finish, and the prompts
    from that one on stay ``None`` (a time budget). ``constrain(index)``: the grammar state
    (``grammar.Constraint``) prompt ``index``'s tokens are chosen under, or None."""
    eos = eos_token_ids(tokenizer) if eos is None else eos
    if make_stop is None:
        def make_stop(_: int) -> ResponseStop:
            return ResponseStop(tokenizer, eos, max_new_tokens, fmt=fmt)
    out: list[Generation | None] = [None] * len(prompts)
    if not prompts:
        return []
    device = target.device
    arena = target.new_arena(min(batch_size, len(prompts)), max(map(len, prompts)) + max_new_tokens)
    rows: list[_Row | None] = [None] * arena.rows
    queue = deque(range(len(prompts)))
    holder: tuple[int, list[int]] | None = None  # (row, prompt) of the newest admission: its prompt KV is intact
    holder_aux: torch.Tensor | None = None  # [P, 3·H] the holder's prompt features (capture)

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", torch.float16)

    def push(r: int, token: int, logits: torch.Tensor) -> None:  # the target's greedy token, its logits [V]
        row = rows[r]
        if row.constraint is not None:
            choice = int(logits.masked_fill(~row.constraint.next_allowed(), float("-inf")).argmax())
            row.greedy.append(token)
            row.constraint.advance([choice])
            token = choice
        row.stop.push([token])
        if row.stop.done:
            s = row.stop
            out[row.index] = Generation(ids=list(s.ids), text=s.text, stop=s.reason or "length",
                                        prefilled=row.prefilled,
                                        aux=torch.cat(row.aux) if capture else None,
                                        final=torch.cat(row.final) if capture else None,
                                        greedy=row.greedy[: len(s.ids)] if row.greedy is not None else None)
            rows[r] = None
            if on_done is not None:
                on_done(row.index, out[row.index])
                if capture:  # the callback took the features: a long stream must not hold them all
                    out[row.index] = replace(out[row.index], aux=None, final=None)
        else:
            row.pending = token

    def start(r: int, i: int) -> None:
        nonlocal holder, holder_aux
        p = prompts[i]
        shared = 0
        if holder is not None:
            shared = min(common_prefix(holder[1], p), len(p) - 1)  # at least one token yields the logits
            if shared and holder[0] != r:
                arena.copy_prefix(holder[0], r, shared)
        pos = torch.arange(shared, len(p), device=device)[None]  # [1, T]
        visible = causal_visibility(pos, len(p))  # [1, T, len(p)]
        f = target(torch.tensor(p[shared:], device=device)[None], pos, visible, pos, arena,
                   rows=torch.tensor([r], device=device), logits_at=torch.tensor([[len(p) - shared - 1]], device=device))
        holder = (r, p)
        constraint = constrain(i) if constrain is not None else None
        rows[r] = _Row(index=i, length=len(p), pending=-1, stop=make_stop(i), prefilled=len(p) - shared,
                       constraint=constraint, greedy=[] if constraint is not None else None)
        if capture:  # same tokens at the same positions: the shared prefix's features are the holder's
            holder_aux = torch.cat([holder_aux[:shared], keep(f.aux[0])]) if shared else keep(f.aux[0])
            rows[r].aux, rows[r].final = [holder_aux], [keep(f.final[0])]
        push(r, int(f.logits[0, 0].argmax()), f.logits[0, 0])

    def next_prompt() -> int | None:
        if queue and admit is not None and not admit(queue[0]):
            queue.clear()
        return queue.popleft() if queue else None

    while queue or any(row is not None for row in rows):
        for r in range(arena.rows):
            while rows[r] is None and (i := next_prompt()) is not None:  # a response can end at its first token
                start(r, i)
        active = [r for r in range(arena.rows) if rows[r] is not None]
        if not active:
            continue
        pos = torch.tensor([[rows[r].length] for r in active], device=device)  # [A, 1]
        span = int(pos.max()) + 1
        visible = causal_visibility(pos, span)  # [A, 1, S]
        tokens = torch.tensor([[rows[r].pending] for r in active], device=device)  # [A, 1]
        index = None if len(active) == arena.rows else torch.tensor(active, device=device)
        spans = [(r, rows[r].length + 1) for r in active]
        f = target(tokens, pos, visible, pos, arena, rows=index, spans=spans)
        aux = keep(f.aux) if capture else None  # [A, 1, 3·H]
        final = keep(f.final) if capture else None  # [A, 1, H]
        for b, (r, token) in enumerate(zip(active, f.logits[:, 0].argmax(-1).tolist())):
            rows[r].length += 1
            if capture:
                rows[r].aux.append(aux[b])
                rows[r].final.append(final[b])
            push(r, token, f.logits[b, 0])
    return out
