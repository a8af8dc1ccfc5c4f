"""Tree utilities and greedy acceptance on small literal cases."""

from __future__ import annotations

import pytest
import torch

from infer.rounds.tree import (
    ROOT,
    ancestor_mask,
    ancestors,
    chain,
    check_parents,
    depths,
    greedy_accept,
    merge,
    paths,
    prune,
)

#        root
#       /    \
#      0(a)   1(b)
#     /   \     \
#   2(c)  3(d)   4(e)
#    |
#   5(f)
PARENTS = [ROOT, ROOT, 0, 0, 1, 2]
TOKENS = [10, 11, 12, 13, 14, 15]


def test_depths_ancestors_paths():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert ancestors(PARENTS, 5) == [0, 2, 5]
    assert sorted(paths(PARENTS)) == [[0, 2, 5], [0, 3], [1, 4]]


def test_ancestor_mask():
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(PARENTS), want)


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="node 1"):
        check_parents([ROOT, 1])


@pytest.mark.parametrize("choice, accepted, correction", [
    # choice[0] at the root, choice[1 + i] at node i
    ([10, 12, 0, 15, 0, 0, 99], [0, 2, 5], 99),  # the whole deepest path, then the bonus token
    ([10, 13, 0, 0, 77, 0, 0], [0, 3], 77),  # second child of node 0, then correction
    ([11, 0, 14, 0, 0, 55, 0], [1, 4], 55),  # the other subtree
    ([10, 16, 0, 0, 0, 0, 0], [0], 16),  # node 0 ok, no child matches
    ([42, 0, 0, 0, 0, 0, 0], [], 42),  # nothing matches: the target's token alone
])
def test_greedy_accept(choice, accepted, correction):
    assert greedy_accept(TOKENS, PARENTS, choice) == (accepted, correction)


def test_greedy_accept_empty_tree_is_one_ar_step():
    assert greedy_accept([], [], [7]) == ([], 7)


def test_merge_shares_equal_prefixes():
    a = chain([1, 2, 3])
    b = ([1, 2, 4, 5], [ROOT, 0, 1, 2])
    tokens, parents = merge([a, b])
    assert tokens == [1, 2, 3, 4, 5]
    assert parents == [ROOT, 0, 1, 1, 3]


def test_prune_drops_forbidden_nodes_with_their_subtrees():
    #      root
    #     /    \
    #    0      3
    #   / \     |
    #  1   2    4
    #  |
    #  5
    parents = [ROOT, 0, 0, ROOT, 3, 1]
    index, new_parents = prune(parents, [True, False, True, True, True, True])  # 1 goes, and 5 below it
    assert index == [0, 2, 3, 4] and new_parents == [ROOT, 0, ROOT, 2]
    assert prune(parents, [False] + [True] * 5) == ([3, 4], [ROOT, 0])
    assert prune(parents, [True] * 6) == (list(range(6)), parents)
