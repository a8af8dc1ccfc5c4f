"""The batch's best call: what each request of a batched round prices its draft against,
literal cases (``infer/rounds/share.batch_shares``)."""

from __future__ import annotations

import pytest

from infer.rounds.share import ALONE, Offer, Share, batch_shares


def linear(n: int) -> float:
    """10 ms a call, 4 ms a further row."""
    return 6.0 + 4.0 * n


def test_a_lone_request_prices_against_nothing():
    assert batch_shares([Offer([-1, 0], [0.9, 0.5])], linear) == [ALONE]
    assert batch_shares([Offer([], [])], linear) == [ALONE]


def test_a_node_that_beats_plain_decoding_but_not_the_best_call_is_left_out():
    """0.6 pays beside the other's plain decoding (2.6 / 18 > 2 / 14), not beside its chain
    (4.45 / 26 < 3.85 / 22): the best call keeps the chain alone."""
    shares = batch_shares([Offer([-1, 0], [0.95, 0.9]), Offer([-1], [0.6])], linear)
    assert shares == [Share(1, 1.0), Share(3, pytest.approx(2.85))]
    # a node worth 0.8 beats the best call's rate (4.65 / 26 > 3.85 / 22): both requests draft
    shares = batch_shares([Offer([-1, 0], [0.95, 0.9]), Offer([-1], [0.8])], linear)
    assert shares == [Share(2, pytest.approx(1.8)), Share(3, pytest.approx(2.85))]


def test_a_child_never_outranks_its_parent():
    """A child worth more than its parent counts at its parent's value: the chain's second node
    (0.9 under 0.5) comes in with the first or not at all."""
    rich = Offer([-1], [0.7])
    assert batch_shares([Offer([-1, 0], [0.5, 0.9]), rich], linear) == [Share(2, pytest.approx(1.7)), Share(1, 1.0)]
    assert batch_shares([Offer([-1, 0], [0.9, 0.5]), rich], linear) == \
        [Share(2, pytest.approx(1.7)), Share(2, pytest.approx(1.9))]


def test_a_requests_fixed_rows_are_in_the_others_shares_only():
    """A request's pending rows (and a prefill's root row and SIDE contexts) sit in the others'
    shares only; with nothing offered, the shares are plain decoding's."""
    shares = batch_shares([Offer([], [], 2), Offer([], [], 1), Offer([], [], 1)], linear)
    assert shares == [Share(2, 2.0), Share(3, 2.0), Share(3, 2.0)]
