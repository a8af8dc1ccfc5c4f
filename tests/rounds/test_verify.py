"""Verification's pure steps and the arena's regions, on small literal cases."""

from __future__ import annotations

import torch

from infer.rounds.arena import ArenaLayout
from infer.rounds.call import Segment
from infer.rounds.sampling import Sampler
from infer.rounds.tree import ROOT
from infer.rounds.verify import chain_and_tree, choose, with_segments


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_pending_chain_and_tree_visibility():
    # 2 committed rows, a pending chain of 2, a tree: a (off the root), b (child of a), c (off the root)
    assert rows(chain_and_tree(2, 2, [ROOT, 0, ROOT])) == [
        "xxx....",  # chain 0: committed + itself
        "xxxx...",  # chain 1
        "xxxxx..",  # a: committed + whole chain + a
        "xxxxxx.",  # b: ... + a + b
        "xxxx..x",  # c: not a, not b
    ]


def test_prefill_is_a_causal_prompt_with_the_tree_after_it():
    assert rows(chain_and_tree(0, 3, [ROOT])) == ["x...", "xx..", "xxx.", "xxxx"]


def test_segments_see_exactly_their_rows_and_widen_the_mask():
    main = chain_and_tree(1, 1, [])  # [1, 2]
    seg = Segment(tokens=[7, 8], positions=[5, 6], slots=[9, 10], visible=[[0, 9], [0, 9, 10]])
    assert rows(with_segments(main, [seg])) == [
        "xx.........",
        "x........x.",
        "x........xx",
    ]
    assert torch.equal(with_segments(main, []), main)


def test_choice_obeys_the_grammar_then_greedy_or_sampled():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.0]])  # [N=2, V=3]
    assert choose(logits, None, None) == [1, 0]
    assert choose(logits, None, Sampler(0.0)) == [1, 0]
    allowed = torch.tensor([[True, False, True], [False, False, True]])
    assert choose(logits, allowed, None) == [2, 2]
    # sampled: only allowed tokens are ever drawn
    draws = [choose(logits, allowed, Sampler(1.0, seed=s)) for s in range(30)]
    assert {d[1] for d in draws} == {2} and {d[0] for d in draws} == {0, 2}


def test_arena_regions_follow_each_other():
    layout = ArenaLayout(prompt_len=10, max_new_tokens=20, scratch=8, side_capacity=100)
    assert (layout.positions, layout.side_base, layout.capacity) == (31, 39, 139)
    assert ArenaLayout(10, 20, 8).capacity == 39  # no SIDE pool
