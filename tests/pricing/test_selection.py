"""Cost-aware selection: the pure parts with literal cases, the measured cost curve
on a real forward, and losslessness of every method with selection on."""

from __future__ import annotations

import json

import pytest

from infer.pricing.acceptance import AcceptanceStats, default_prior, head_source
from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel, LiveCost, isotonic, load_or_measure, measure, size_bucket, still_holds
from infer.pricing.selection import expected_rate, path_values, select
from infer.rounds.candidates import Candidates, chain_source
from infer.rounds.tree import ROOT
from schemafill.config import DecodeConfig
from tests.conftest import tiny_llama


def linear(a: float, b: float):
    return lambda n: a + b * n


# ---------------------------------------------------------------- selection
def test_path_values_multiply_conditional_acceptance_down_the_tree():
    assert path_values([ROOT, 0, 0, 1], [0.5, 0.8, 0.2, 1.0]) == pytest.approx([0.5, 0.4, 0.1, 0.4])
    assert path_values([ROOT], [1.7]) == [1.0]  # an estimate is a probability


def test_select_stops_where_the_next_node_costs_more_than_it_brings():
    # chain with values 0.9, 0.5, 0.05; c(n) = 10 + 2n, one fixed row:
    # k=0: 1/12  k=1: 1.9/14  k=2: 2.4/16 = 0.15 (best)  k=3: 2.45/18
    assert select([ROOT, 0, 1], [0.9, 0.5, 0.05], linear(10, 2), fixed_rows=1) == [0, 1]
    # rows nearly free (a GPU): every node with any value is worth it
    assert select([ROOT, 0, 1], [0.9, 0.5, 0.05], linear(10, 0.001), fixed_rows=1) == [0, 1, 2]
    # rows expensive against the round: the target's own token alone
    assert select([ROOT, 0, 1], [0.9, 0.5, 0.05], linear(1, 10), fixed_rows=1) == []  # 1/11 > 1.9/21


def test_a_fixed_host_estimate_keeps_selection_off_the_clock():
    curve = CostModel((1, 64), (60.0, 3210.0))  # 10 + 50 ms a row: rows are dear unless the round is long
    cand = Candidates([5, 6, 7], [ROOT, 0, 1], [head_source(0.9)] * 3)
    fixed = NodeBudget(curve, fixed_host_ms=100.0)
    fixed.host(1.0)  # a fast round changes nothing
    assert fixed.host_ms == 100.0
    assert len(fixed.choose(cand)) == 3  # beside 100 ms of host work every node pays
    measured = NodeBudget(curve)
    measured.host(1.0)
    assert measured.host_ms == 1.0 and len(measured.choose(cand)) < 3
    with pytest.raises(ValueError, match="decode.host_ms"):
        DecodeConfig(host_ms=-1.0)


def test_select_counts_host_time_in_the_round():
    # with 100 ms of host work per round a row's 2 ms are cheap: all three nodes pay
    assert select([ROOT, 0, 1], [0.9, 0.5, 0.05], linear(10, 2), fixed_rows=1, host_ms=100) == [0, 1, 2]


def test_select_is_closed_under_ancestors_and_prefers_likelier_branches():
    parents = [ROOT, ROOT, 0, 1, 3]
    values = [0.2, 0.7, 0.9, 0.6, 0.5]  # node 2 claims more than its parent: clamped to 0.2
    kept = select(parents, values, linear(10, 1), fixed_rows=1, max_nodes=3)
    assert kept == [1, 3, 4]
    for i in select(parents, values, linear(10, 0.1), fixed_rows=1):
        assert parents[i] == ROOT or parents[i] in select(parents, values, linear(10, 0.1), fixed_rows=1)


def test_select_keeps_what_it_is_told_to_with_its_ancestors():
    assert select([ROOT, 0, 1], [0.1, 0.1, 0.1], linear(1, 100), keep=(2,)) == [0, 1, 2]


def test_expected_rate_is_what_select_maximises():
    parents, values, cost = [ROOT, 0, ROOT], [0.8, 0.6, 0.3], linear(20, 3)
    best = select(parents, values, cost, fixed_rows=2)
    for other in ([], [0], [0, 1], [0, 2], [0, 1, 2]):
        assert expected_rate(values, best, cost, 2) >= expected_rate(values, other, cost, 2) - 1e-12


# ---------------------------------------------------------------- acceptance estimates
def test_stats_count_a_node_only_when_its_parent_was_accepted():
    stats = AcceptanceStats(strength=0.0)
    parents = [ROOT, 0, 0, ROOT, 3]
    sources = ["a:1", "a:2", "b:1", "b:1", "b:2"]
    stats.observe(parents, sources, accepted=[0, 1])
    # reached: 0 and 3 (children of the root), 1 and 2 (children of accepted 0); 4's parent was rejected
    assert stats.table() == {"a:1": {"reached": 1, "accepted": 1, "rate": 1.0},
                             "a:2": {"reached": 1, "accepted": 1, "rate": 1.0},
                             "b:1": {"reached": 2, "accepted": 0, "rate": 0.0}}


def test_stats_start_from_the_prior_and_move_with_evidence():
    stats = AcceptanceStats()
    assert stats.rate(head_source(0.93)) == pytest.approx(default_prior("head:9")) == pytest.approx(0.95)
    assert stats.rate("pack:2") == 0.5
    for _ in range(36):
        stats.observe([ROOT], ["pack:1"], accepted=[0])
    assert stats.rate("pack:1") == pytest.approx((36 + 4 * 0.5) / 40)
    # depths 1-4 on their own, then pooled by doubling ranges: a long copy's deep nodes learn apart
    assert [chain_source("copy", d) for d in (1, 4, 5, 8, 9, 16, 17, 40)] == \
        ["copy:1", "copy:4", "copy:8", "copy:8", "copy:16", "copy:16", "copy:32", "copy:32"]


def test_merged_candidates_keep_the_better_rated_source_of_a_shared_node():
    rates = {"head:2": 0.25, "pack:1": 0.9, "pack:2": 0.9, "head:9": 0.95}.get
    head = Candidates([5, 6, 7], [ROOT, 0, 0], ["head:2", "head:9", "head:2"])
    packed = Candidates.chain([5, 6, 8], "pack")
    m = Candidates.merged([head, packed], rates)
    assert (m.tokens, m.parents) == ([5, 6, 7, 8], [ROOT, 0, 0, 1])
    assert m.sources == ["pack:1", "head:9", "head:2", "pack:3"]
    sub = m.subset([0, 2])
    assert (sub.tokens, sub.parents, sub.sources) == ([5, 7], [ROOT, 0], ["pack:1", "head:2"])


def test_node_budget_without_a_cost_model_keeps_every_candidate():
    cand = Candidates.chain([1, 2, 3, 4], "ngram")
    assert NodeBudget().choose(cand).tokens == [1, 2, 3, 4]
    # with a steep cost and cautious priors, a 4-node chain shrinks
    steep = CostModel((1, 64), (10.0, 10.0 + 64 * 20))
    assert len(NodeBudget(steep).choose(cand)) < 4


def test_a_drafting_level_must_beat_the_rate_the_round_promises():
    curve = CostModel((1, 64), (10.0, 136.0))  # c(n) = 8 + 2n
    budget = NodeBudget(curve)
    assert budget.keep([ROOT, 0], [0.9, 0.5], fixed_rows=1) == [0, 1]  # (1 + 1.4) tokens / c(3) = 14 ms: 0.171 per ms
    assert budget.rate == pytest.approx(2.4 / 14)
    assert budget.level_worth(0.5, 2.0)  # 0.25 per ms beats it
    assert not budget.level_worth(0.3, 2.0)  # 0.15 per ms does not
    # the fixed budget, and selection kept off the clock, draft every level
    assert NodeBudget().level_worth(0.0, 100.0)
    assert NodeBudget(curve, fixed_host_ms=5.0).level_worth(0.0, 100.0)
    # a head draft's chance is its probability bucket's measured rate
    budget.stats.observe([ROOT, ROOT], [head_source(0.35)] * 2, [])  # both rejected
    assert budget.draft_rate(0.31) == budget.stats.rate("head:3") < default_prior("head:3")


# ---------------------------------------------------------------- cost model
def test_cost_model_interpolates_is_monotone_and_extrapolates():
    c = CostModel.fit((1, 4, 16), (10.0, 16.0, 12.0))  # noise made 16 rows look cheaper than 4
    assert c.ms == (10.0, 14.0, 14.0)  # the violating pair pooled into its mean
    assert c(1) == 10.0 and c(0) == 10.0
    assert c(2) == pytest.approx(10.0 + 4.0 / 3)
    assert c(32) == pytest.approx(14.0)  # last segment flat
    # one slow sample is averaged with the sizes after it, not carried over them (a running maximum
    # read c(2), c(4), c(8) all as 105 ms on a 2-core EPYC)
    outlier = CostModel.fit((1, 2, 4, 8, 16), (59.8, 105.0, 90.0, 95.0, 121.3))
    assert outlier.ms == pytest.approx((59.8, 96.667, 96.667, 96.667, 121.3), abs=1e-3)
    assert isotonic([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])
    c2 = CostModel((1, 2, 4), (10.0, 12.0, 16.0))
    assert c2(8) == pytest.approx(24.0)
    assert c2.linear_fit() == pytest.approx((8.0, 2.0))
    with pytest.raises(ValueError, match="increasing"):
        CostModel((4, 1), (1.0, 2.0))
    with pytest.raises(ValueError, match="CostModel.fit"):  # a raw, decreasing measurement is not a curve
        CostModel((1, 4), (10.0, 9.0))


def test_live_cost_learns_each_size_bucket_and_side_calls_apart():
    assert [size_bucket(n) for n in (1, 3, 8, 9, 16, 17, 64, 65)] == [1, 3, 8, 16, 16, 32, 64, 128]
    live = LiveCost(CostModel((1, 64), (40.0, 166.0)))  # 38 + 2 ms a row
    assert live(9) == 56.0 and live(9, side=True) == 56.0  # nothing measured: the curve
    for _ in range(4):
        live.observe(12, side=False, ms=82.0)  # 20 ms above the curve's 62 at 12 rows
    # 4 calls against 4 pseudo-calls: half the gap; one measured point shifts the whole curve
    assert live(9) == pytest.approx(56.0 + 10.0) and live(16) == pytest.approx(70.0 + 10.0)
    assert live(9, side=True) == 56.0  # SIDE calls: untouched
    live.observe(5, side=True, ms=10_000.0)  # one stall moves its bucket by at most the curve's value, shrunk
    assert live(5, side=True) == pytest.approx(48.0 + 48.0 / 5)
    frozen = LiveCost(CostModel((1, 64), (40.0, 166.0)), learn=False)
    frozen.observe(12, side=False, ms=82.0)
    assert frozen(12) == 62.0 and frozen.summary()["measured"] == {}
    assert live.summary()["measured"]["16"] == {"calls": 4, "mean_rows": 12.0, "ms": 82.0 - 10.0, "correction_ms": 20.0}


def test_live_cost_is_continuous_and_never_decreases_across_buckets():
    live = LiveCost(CostModel((1, 64), (40.0, 166.0)), strength=0.0)  # 38 + 2 ms a row; no shrinking
    for rows, ms in ((4, 66.0), (12, 62.0), (24, 106.0)):  # corrections +20 at 4 rows, 0 at 12, +20 at 24
        live.observe(rows, side=False, ms=ms)
    # 4 rows measured above 12 rows: the two are pooled to their mean, so no row makes a call cheaper
    assert live(4) == live(12) == pytest.approx(64.0) and live(24) == pytest.approx(106.0)
    # between two measured sizes the correction moves in proportion (+2 ms at 12 rows, +20 at 24):
    # no step at a bucket's edge
    assert live(17) - live(16) == pytest.approx(2.0 + (20.0 - 2.0) / 12)
    costs = [live(n) for n in range(1, 100)]
    assert all(b >= a for a, b in zip(costs, costs[1:]))
    # a batch measured below the single-request curve at 32 rows, above it at 16: still non-decreasing
    batched = LiveCost(CostModel((1, 64), (40.0, 166.0)), strength=0.0)
    batched.observe(16, side=False, ms=70.0 + 32.0)
    batched.observe(30, side=False, ms=98.0 - 10.0)
    costs = [batched(n) for n in range(1, 100)]
    assert all(b >= a for a, b in zip(costs, costs[1:])) and costs[15] == costs[29] == pytest.approx(95.0)


def test_cost_is_measured_on_a_real_forward_and_cached_per_host(tmp_path):
    from schemafill.runtime.loading import from_hf_model

    target = from_hf_model(tiny_llama(vocab_size=512, num_hidden_layers=2, hidden_size=64, intermediate_size=128))
    first, fresh = load_or_measure(target, tmp_path, context=64, sizes=(1, 8, 64), repeats=3)
    assert fresh and first.sizes == (1, 8, 64) and all(ms > 0 for ms in first.ms)
    assert "cpu" in first.key and "threads" in first.key
    again, fresh = load_or_measure(target, tmp_path, context=64, sizes=(1, 8, 64), repeats=3)
    assert not fresh and again.ms == first.ms
    # a damaged entry is measured again, never trusted
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    _, fresh = load_or_measure(target, tmp_path, context=64, sizes=(1, 8, 64), repeats=3)
    assert fresh and json.loads(entry.read_text())["sizes"] == [1, 8, 64]
    # a curve cached in a slow hour (every call 50x what it costs now) is measured again
    saved = json.loads(entry.read_text())
    entry.write_text(json.dumps({**saved, "ms": [50 * ms + 50 for ms in saved["ms"]]}))
    stale = CostModel(tuple(saved["sizes"]), tuple(50 * ms + 50 for ms in saved["ms"]), 64)
    assert not still_holds(target, stale) and still_holds(target, CostModel(tuple(saved["sizes"]), tuple(saved["ms"]), 64))
    remeasured, fresh = load_or_measure(target, tmp_path, context=64, sizes=(1, 8, 64), repeats=3)
    assert fresh and remeasured.ms[0] < 50
    assert measure(target, context=32, sizes=(1, 2), repeats=1).context == 32


def test_an_unwritable_cache_still_gives_a_curve(tmp_path, capsys):
    from schemafill.runtime.loading import from_hf_model

    target = from_hf_model(tiny_llama(vocab_size=512))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    model, fresh = load_or_measure(target, blocked / "cost", context=16, sizes=(1, 4), repeats=1)
    assert fresh and model.sizes == (1, 4)
    assert "could not cache the cost curve" in capsys.readouterr().out
