"""Batches in the round loop: several requests, of different methods, verified in one target
forward per round; each one's tokens equal its own batch-1 AR output whatever it is batched
with, joining and leaving between rounds, its prompt in pieces while others decode."""

from __future__ import annotations

import pytest
import torch

from infer.decoders import eagle3, ngram, slot_parallel, suffix, toolspec
from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel
from infer.pricing.selection import select
from infer.proposers.head import SCHEMAFILL_BUDGET, TreeBudget
from infer.rounds import loop
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.rounds.sampling import Sampler
from infer.rounds.share import Offer, Share
from infer.slots.policy import SchemaFillConfig
from schemafill.config import NgramConfig, SuffixConfig, ToolSpecConfig
from schemafill.contract.prompt import prompt_ids
from schemafill.runtime.grammar import SchemaGrammars
from schemafill.runtime.loading import load_target, load_tokenizer
from tests.conftest import decode_ar
from tests.decoders.test_schemafill import CASES, random_head, request

STEEP = CostModel((1, 64), (10.0, 10.0 + 63 * 4.0))  # rows cost enough that selection prunes


class Cancelled(Exception):
    pass


def cancel_after(n: int):
    def on_commit(ids: list[int], logprobs=None) -> None:
        if len(ids) >= n:
            raise Cancelled()
    return on_commit


@pytest.fixture(scope="module")
def tiny(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    return target, tok, frozenset({tok.eos_token_id})


def methods(target, tok, eos, max_new):
    rt = Runtime(target, tok, eos, max_new)
    head = random_head(target)
    return {"ar": None,
            "eagle3": eagle3.declare(rt, head, TreeBudget(3, 3, 10), NodeBudget(STEEP)),
            "ngram": ngram.declare(rt, NgramConfig()),
            "suffix": suffix.declare(rt, SuffixConfig(), NodeBudget(STEEP)),
            "toolspec": toolspec.declare(rt, ToolSpecConfig()),
            "schemafill": slot_parallel.declare(rt, head, SchemaFillConfig(budget=SCHEMAFILL_BUDGET), NodeBudget(STEEP))}


def test_a_batch_of_every_method_and_edge_case_equals_each_requests_batch_1_output(tiny):
    """Thirteen requests, two or three per method, decoded three to five at a time with prompts in pieces:
    stopping at the first token, at the length cap, under the response grammar, sampled, and
    cancelled mid-way, each beside the others. Every greedy one, and AR's sample under its seed,
    ends as it ends alone; a speculative sample ends as a sample does."""
    target, tok, eos = tiny
    decoders = methods(target, tok, eos, 24)
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    rt = Runtime(target, tok, eos, 24)
    names = list(CASES)
    jobs = []  # (method, request, prompt, options factory, what it must equal)
    # 0 first token, 1 length cap, 2 grammar, 3 sampled, 4 cancelled, 5 plain
    cases = {"ar": (3, 0), "eagle3": (1, 2), "ngram": (4, 5), "suffix": (0, 2), "toolspec": (3, 1),
             "schemafill": (4, 2, 5)}
    for k, (method, decoder) in enumerate(decoders.items()):
        for j, case in enumerate(cases[method]):
            req = request(names[(2 * k + j) % len(names)])
            ids = prompt_ids(req, "plain", tok)
            if case == 0:
                opts = lambda: DecodeOptions(max_new_tokens=1)  # noqa: E731 - stops at the first token
            elif case == 1:
                opts = lambda: DecodeOptions(max_new_tokens=5)  # noqa: E731
            elif case == 2:
                opts = lambda req=req: DecodeOptions(constraint=grammars.constraint(req.functions))  # noqa: E731
            elif case == 3:
                opts = lambda: DecodeOptions(sampler=Sampler(0.8, 0.95, seed=11))  # noqa: E731
            elif case == 4:
                opts = lambda: DecodeOptions(on_commit=cancel_after(3))  # noqa: E731
            else:
                opts = lambda: DecodeOptions()  # noqa: E731
            alone = None if case == 4 else decode_ar(target, tok, ids, opts().cap(24), eos, opts().sampler,
                                                      opts().constraint)
            jobs.append((method, decoder, req, ids, opts, alone))

    def make(method, decoder, req, ids, opts):
        if decoder is None:
            return lambda: loop.Stream(rt, ids, opts(), loop.Drafting())
        return lambda: decoder.stream(req, ids, opts())

    for concurrency, pieces in ((3, 16), (5, 7)):
        ended = dict(loop.decode_all(target, [make(*job[:5]) for job in jobs], concurrency, prefill_tokens=pieces))
        assert sorted(ended) == list(range(len(jobs)))
        for i, (method, _, req, _, opts, alone) in enumerate(jobs):
            stream = ended[i]
            if opts().on_commit is not None:
                assert isinstance(stream.error, Cancelled), (method, req.id)
                continue
            assert stream.error is None, (method, req.id, stream.error)
            out = stream.decoded()
            if opts().sampler is not None and method != "ar":
                # a speculative sample draws as its drafts dictate: the same distribution, not the same draw
                assert out.stop in ("closed", "eos", "length") and 0 < len(out.ids) <= 24, (method, req.id)
                continue
            assert out.ids == alone.ids and out.stop == alone.stop, (method, req.id, concurrency)


def test_batched_rounds_verify_every_request_in_one_forward_and_prefill_in_pieces(tiny):
    """Two AR requests and one whose prompt joins later: each round is one forward, a prompt
    longer than the round's allowance goes in pieces beside the decoding ones, and the pieces
    leave the KV a whole prefill would."""
    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 16)
    prompts = [prompt_ids(request(n), "plain", tok) for n in ("bm25", "one_tool")]
    prompts.append(prompt_ids(request("twenty"), "plain", tok)[:150])
    forwards = []
    real = target.packed

    def counting(tokens, positions, parts, logits_at=None):
        forwards.append([p.slots.shape[0] for p in parts])
        return real(tokens, positions, parts, logits_at)

    target.packed = counting
    try:
        batch = loop.Batch(target, prefill_tokens=32)
        first = [loop.Stream(rt, p, DecodeOptions(), loop.Drafting()) for p in prompts[:2]]
        for st in first:
            batch.add(st)
        batch.step()
        assert forwards[-1] == [len(prompts[0]), len(prompts[1])]  # nobody decodes yet: whole prompts
        late = loop.Stream(rt, prompts[2], DecodeOptions(), loop.Drafting())
        batch.add(late)
        while not late.prefilled:
            batch.step()
        pieces = [rows[0] for rows in forwards[1:]]  # the late prompt first in each forward
        # pieces of at least prefill_tokens (more where the rest of a round takes longer:
        # ``prompt_budget``, from timing: how many pieces is the host's), the last prompt token
        # with the prefill's call
        assert len(pieces) >= 2 and sum(pieces) == 150 and min(pieces[:-1]) >= 32
        assert all(rows[1:] == [1, 1] for rows in forwards[1:])  # the others went on decoding, one row each
        while batch.streams:
            batch.step()
    finally:
        del target.packed
    for st, p in zip(first + [late], prompts):
        assert st.decoded().ids == decode_ar(target, tok, p, 16, eos).ids


def test_selection_prices_a_requests_rows_as_part_of_the_batch():
    """Alone, a node worth 0.5 tokens is kept at 4 ms a row on a 10 ms call; beside seven
    requests that bring 14 tokens for 8 rows, the same node is not worth a row."""
    cost = STEEP
    parents, values = [-1, 0], [0.5, 0.2]
    assert select(parents, values, cost, fixed_rows=1) == [0]
    share = Share(rows=8, tokens=14.0)
    assert select(parents, values, lambda n: cost(n + share.rows), 1, base=1 + share.tokens) == []
    budget = NodeBudget(STEEP)
    assert budget.best(parents, values, 1)[0] == [0] and budget.best(parents, values, 1, share=share)[0] == []


class Offering(loop.Drafting):
    """Priced drafting whose candidates are given as values (what ``select`` would read)."""

    def __init__(self, values: list[float] | None = None) -> None:
        super().__init__(NodeBudget(STEEP))
        self.given = values or []

    def offer(self, s, p):
        return Offer([-1 + i for i in range(len(self.given))], self.given, s.pending)


def test_a_prompt_ending_this_round_offers_its_first_proposal_beside_the_batchs_drafts(tiny):
    """A prompt piece is in nobody's share (a prompt's KV is owed whatever anyone drafts). A
    prompt that ends this round offers its first proposal — SchemaFill's forecast tree — as one
    more request's draft of the batch's best call: its root row (the prompt's last token) and new
    SIDE contexts fixed, its nodes priced like any round's, and its prefill carries only the part
    that pays (here at 4 ms a row beside a request whose draft is sure, not the whole tree)."""
    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 16)
    sf = methods(target, tok, eos, 16)["schemafill"]
    decoding = loop.Stream(rt, prompt_ids(request("one_tool"), "plain", tok), DecodeOptions(), Offering([0.99]))
    batch = loop.Batch(target, prefill_tokens=32)
    batch.add(decoding)
    batch.step()
    late = loop.Stream(rt, prompt_ids(request("twenty"), "plain", tok)[:150], DecodeOptions(), loop.Drafting())
    assert not late.finishes_prompt(32) and late.next_call(prefill_tokens=32).kind == "chunk"

    r = request("one_tool")
    joining = sf.stream(r, prompt_ids(r, "plain", tok), DecodeOptions())
    assert joining.finishes_prompt(None)
    tree, contexts = len(joining.drafted.cand), sum(len(seg.tokens) for seg in joining.drafted.extra)
    assert tree > 1  # the forecast's first proposal, to ride with the prefill
    (share, _), (joining_share, offer) = loop.Batch._shares([decoding, joining])
    assert offer.fixed_rows == 1 + contexts and len(offer.values) == tree
    assert share.rows >= 1 + contexts and joining_share.rows >= 1  # each in the other's share
    prefill = joining.next_call(joining_share, None, offer)
    assert prefill.kind == "prefill" and 0 < len(prefill.tree_tokens) < tree
    assert prefill.rows == len(joining.s.prompt) + len(prefill.tree_tokens) + prefill.extra_rows


def test_each_request_prices_its_draft_against_the_batchs_best_call(tiny):
    """Two decoding requests: one drafts a chain worth 0.95 and 0.9, the other a node worth
    0.6, at 10 ms a call and 4 ms a further row. Against plain decoding of the other (2 tokens
    for 14 ms), 0.6 pays (2.6 / 18 ms); against the batch's best call, the first request's chain
    kept (3.85 tokens for 22 ms), it lowers the rate (4.45 / 26 ms): each request's share is the
    rest of that call, and each one's own selection then keeps exactly its part of it."""
    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 16)
    chain, lone = Offering([0.95, 0.9]), Offering([0.6])
    streams = [loop.Stream(rt, prompt_ids(request(n), "plain", tok), DecodeOptions(), d)
               for n, d in (("one_tool", chain), ("bm25", lone))]
    for st in streams:
        st.s.prefill()
        st.prefilled = True
    shares, offers = zip(*loop.Batch._shares(streams))
    assert shares == (Share(1, 1.0), Share(3, pytest.approx(2.85)))
    assert [o.values for o in offers] == [[0.95, 0.9], [0.6]]  # what each one's selection then reads
    assert select([-1], [0.6], lambda n: STEEP(n + 1), 1, base=2.0) == [0]  # priced beside plain decoding
    assert select([-1], [0.6], lambda n: STEEP(n + shares[1].rows), 1, base=1 + shares[1].tokens) == []
    assert select([-1, 0], [0.95, 0.9], lambda n: STEEP(n + shares[0].rows), 1, base=1 + shares[0].tokens) == [0, 1]


def test_the_heads_drafting_for_a_batch_is_one_forward_per_step(tiny, monkeypatch):
    """Four EAGLE-3 requests and two SchemaFill ones sharing a head, decoded together: each
    round's head forwards run once for every request that drafts (the catch-ups together, then
    each tree level together, SchemaFill's SIDE entries beside them), and every output is AR's."""
    from infer.proposers.head import HeadStep

    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 16)
    head = random_head(target)
    ways = {"eagle3": eagle3.declare(rt, head, TreeBudget(2, 3, 8)),  # no price: every level, every round
            "schemafill": slot_parallel.declare(rt, head, SchemaFillConfig(budget=SCHEMAFILL_BUDGET))}
    jobs = [("eagle3", n) for n in ("bm25", "one_tool", "repeated", "twenty")] + \
        [("schemafill", n) for n in ("one_tool", "bm25")]
    sizes = []
    real = HeadStep.run_together

    def counting(steps):
        sizes.append(len(steps))
        return real(steps)

    monkeypatch.setattr(HeadStep, "run_together", staticmethod(counting))
    prompts = [prompt_ids(request(n), "plain", tok) for _, n in jobs]
    makes = [lambda m=m, n=n, p=p: ways[m].stream(request(n), p, DecodeOptions()) for (m, n), p in zip(jobs, prompts)]
    ended = dict(loop.decode_all(target, makes, concurrency=len(jobs)))
    outs = [ended[i].decoded() for i in range(len(jobs))]
    assert sum(sizes) == sum(o.head_forwards for o in outs)  # every head forward ran, once
    assert max(sizes) == len(jobs) and len(sizes) < sum(sizes) / 2  # ... most of them together
    for (m, n), p, out in zip(jobs, prompts, outs):
        assert out.ids == decode_ar(target, tok, p, 16, eos).ids, (m, n)


def test_waiting_prompts_get_at_least_as_much_of_a_round_as_the_decoding_requests(tiny):
    """A round of 100 rows (40 of them a prompt's) that took 50 ms of forward and 30 of host
    work: a prompt row costs 0.5 ms, the rest of the round 60 ms, so the next round may carry
    120 prompt tokens where ``prefill_tokens`` says 32; a short round leaves it at 32."""
    target, tok, eos = tiny
    rt = Runtime(target, tok, eos, 8)
    batch = loop.Batch(target, prefill_tokens=32)
    assert batch.prompt_budget() == 32  # nothing measured yet
    st = loop.Stream(rt, prompt_ids(request("twenty"), "plain", tok), DecodeOptions(), loop.Drafting())
    piece = st.next_call(prefill_tokens=40)
    assert piece.kind == "chunk" and piece.rows == 40
    batch._time_prompts([(st, piece)], host_ms=30.0, forward_ms=50.0, rows=100)
    assert batch.row_ms == 0.5 and batch.rest_ms == 30.0 + 50.0 * 60 / 100
    assert batch.prompt_budget() == 120
    batch._time_prompts([], host_ms=2.0, forward_ms=10.0, rows=8)  # too few rows to price a prompt row by
    assert batch.row_ms == 0.5 and batch.prompt_budget() == 32
