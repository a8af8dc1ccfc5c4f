"""Speculation that backs off under load: the literal rule, and a batch whose requests stop
drafting where it does not pay, decoding exactly what AR decodes either way."""

from __future__ import annotations

import torch

from infer.decoders import eagle3
from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel
from infer.proposers.head import TreeBudget
from infer.rounds import loop
from infer.rounds.backoff import LAUNCH_HORIZON, MEASURED, PRIOR_ROUNDS, PROBE_EVERY, PROBE_MOST, DraftWorth, RoundRate
from infer.rounds.decoding import DecodeOptions, Runtime
from schemafill.contract.prompt import prompt_ids
from schemafill.runtime.loading import load_target, load_tokenizer
from tests.conftest import decode_ar
from tests.decoders.test_schemafill import random_head, request


def test_drafting_pays_while_its_gain_beats_what_its_time_costs_the_batch():
    w = DraftWorth()
    for committed in (1, 3, 5):  # 0, 2 and 4 tokens beyond the round's one, 2 ms each
        assert w.worth(rate=10.0)  # not measured over enough rounds yet: it drafts
        w.drafted(committed=committed, ms=2.0)
    assert w.rounds == MEASURED and w.gain == 2.0 and w.ms == 2.0
    assert w.worth(rate=0.9)  # alone: 2 ms cost 1.8 tokens
    assert not w.worth(rate=1.5)  # in a busier batch 2 ms cost 3 tokens
    assert [w.worth(rate=1.5) for _ in range(PROBE_EVERY - 1)] == [False] * (PROBE_EVERY - 2) + [True]  # a probe
    w.drafted(committed=1, ms=2.0)  # nothing gained: the mean falls
    assert w.gain == 1.5 and w.worth(rate=0.7) and not w.worth(rate=0.8)


def test_a_launchs_means_follow_its_recent_traffic():
    faded, kept = DraftWorth(horizon=LAUNCH_HORIZON), DraftWorth()
    for w in (faded, kept):
        for _ in range(3 * LAUNCH_HORIZON):  # hours of tool calls: 2 tokens a round beyond the one
            w.drafted(committed=3, ms=1.0)
        for _ in range(3 * LAUNCH_HORIZON):  # then as long of chat, where drafts are never taken
            w.drafted(committed=1, ms=1.0)
    assert kept.gain == 1.0 and faded.gain < 0.1 and faded.ms == kept.ms == 1.0
    assert faded.rounds == kept.rounds == 6 * LAUNCH_HORIZON
    # a new request at a batch rate of 0.5 tokens a ms: the all-time mean still has it draft
    assert DraftWorth(kept).worth(rate=0.5) and not DraftWorth(faded).worth(rate=0.5)


def test_a_launchs_earlier_requests_weigh_as_prior_rounds():
    prior = DraftWorth()  # the launch's: every request's drafted rounds
    first = DraftWorth(prior)
    for committed in (5, 5, 5):  # 4 tokens beyond one, 2 ms each: the launch learns drafting pays
        first.drafted(committed=committed, ms=2.0)
    assert (prior.rounds, prior.gain, prior.ms) == (3, 4.0, 2.0)
    alone, shrunk = DraftWorth(), DraftWorth(prior)
    for w in (alone, shrunk):
        for _ in range(MEASURED):  # a request whose first rounds gain nothing (a value no draft knows)
            w.drafted(committed=1, ms=2.0)
    assert not alone.worth(rate=0.5)  # on its own three rounds it would stop drafting
    # with the launch's 4 tokens a round worth PRIOR_ROUNDS of its own: (0 + 8 * 4) >= 0.5 * (6 + 8 * 2)
    assert PRIOR_ROUNDS == 8 and shrunk.worth(rate=0.5)
    assert not shrunk.worth(rate=2.0)  # in a busy enough batch it stops all the same


def test_probes_wait_longer_while_they_find_drafting_not_worth_and_drafting_resumes_when_load_falls():
    w = DraftWorth()
    for _ in range(MEASURED):
        w.drafted(committed=2, ms=2.0)  # one token beyond the round's one, 2 ms each
    waits = []
    for _ in range(6):  # a batch where 2 ms cost 4 tokens: skipped rounds, then a probe
        skipped = 0
        while not w.worth(rate=2.0):
            skipped += 1
        waits.append(skipped)
        w.drafted(committed=2, ms=2.0)  # the probe gains what the others did: still not worth
    assert waits == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 4 * PROBE_EVERY - 1] + [PROBE_MOST - 1] * 3
    assert w.worth(rate=0.4)  # the batch thinned out: it drafts at once, no probe needed ...
    assert [w.worth(rate=2.0) for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [True]  # ... and waits anew


def test_a_launch_measured_over_enough_rounds_decides_a_requests_first_rounds():
    prior = DraftWorth()
    for _ in range(PRIOR_ROUNDS - 1):
        prior.drafted(committed=1, ms=2.0)  # drafting never paid on the launch's earlier requests
    assert DraftWorth(prior).worth(rate=1.0)  # under PRIOR_ROUNDS rounds: a new request measures its own
    prior.drafted(committed=1, ms=2.0)
    w = DraftWorth(prior)
    assert not w.worth(rate=1.0) and not w.worth(rate=1.0)  # the launch's means decide from its first round
    assert w.worth(rate=0.0)  # before the batch's rate is measured, it drafts


def test_until_the_launch_is_measured_only_its_first_requests_draft_to_measure_it():
    prior = DraftWorth()
    wave = [DraftWorth(prior) for _ in range(PRIOR_ROUNDS + 3)]  # a first wave joining together
    first = [w.worth(rate=5.0) for w in wave]
    assert first == [True] * PRIOR_ROUNDS + [False] * 3 and prior.measurers == PRIOR_ROUNDS
    assert all(w.worth(rate=5.0) for w in wave[:PRIOR_ROUNDS])  # the measuring ones go on measuring
    for w in wave[:PRIOR_ROUNDS]:
        w.drafted(committed=4, ms=1.0)  # drafting pays: 3 tokens beyond the round's one for 1 ms
    assert prior.rounds == PRIOR_ROUNDS and all(w.worth(rate=1.0) for w in wave[PRIOR_ROUNDS:])  # now measured
    late = [DraftWorth(prior) for _ in range(2)]
    assert all(w.worth(rate=5.0) is False for w in late)  # and it decides a new request's first round
    waiting = DraftWorth(DraftWorth(measurers=PRIOR_ROUNDS))  # the measurers have not drafted a round yet
    assert [waiting.worth(rate=1.0) for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [True]  # a probe


def test_the_rate_is_a_running_mean_of_the_rounds():
    r = RoundRate()
    r.round(8, 16.0)
    assert r.rate == 0.5
    r.round(0, 0.0)  # no time: nothing learnt
    r.round(16, 16.0)
    assert r.rate == 0.75 * 0.5 + 0.25 * 1.0


def test_a_batch_whose_head_is_not_worth_its_time_decodes_as_ar_without_drafting(tiny_target):
    """A random head (its drafts rarely hold) in a batch of six: after its first measured rounds
    each request drafts only its probe rounds, and every output equals AR's."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    rt = Runtime(target, tok, eos, 24)
    method = eagle3.declare(rt, random_head(target), TreeBudget(4, 4, 16), NodeBudget(CostModel((1, 64), (10.0, 50.0))))
    names = ["bm25", "one_tool", "repeated", "twenty", "bm25", "one_tool"]
    prompts = [prompt_ids(request(n), "plain", tok) for n in names]
    streams = [method.stream(request(n), p, DecodeOptions()) for n, p in zip(names, prompts)]
    batch = loop.Batch(target)
    for st in streams:
        batch.add(st)
    drafted = skipped = 0
    while batch.streams:
        live = [st for st in batch.streams if st.prefilled and not st.done]
        batch.step()
        drafted += sum(st.draft_ms is not None for st in live)
        skipped += sum(st.draft_ms is None for st in live)
    assert skipped > drafted  # mostly backed off ...
    assert drafted >= len(streams) * 2  # ... after drafting to measure, and probing
    fixed = eagle3.declare(rt, random_head(target), TreeBudget(4, 4, 16), NodeBudget())  # the fixed budget
    assert not fixed.stream(request("bm25"), prompts[0], DecodeOptions()).drafting.backs_off
    for st, p in zip(streams, prompts):
        assert st.decoded().ids == decode_ar(target, tok, p, 24, eos).ids
