"""The commit step on literal cases: the accepted path, the bonus token, a stop inside an
accepted run, and a draft the grammar rejects."""

from __future__ import annotations

import torch

from infer.rounds.commit import commit
from infer.rounds.tree import ROOT
from infer.rounds.verify import choose


class Response:
    """A response that stops after the token ``stop_at`` (or never): ``push`` as ResponseStop's."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.ids: list[int] = []
        self.stop_at = stop_at

    def push(self, tokens: list[int]) -> int:
        taken = 0
        for t in tokens:
            if self.ids and self.ids[-1] == self.stop_at:
                break
            self.ids.append(t)
            taken += 1
        return taken


def test_the_accepted_path_and_the_bonus_token():
    # tree: 5 -> 6 -> 7, and 8 beside 5; the target chooses 5 at the root, 6 after 5, 9 after 6
    tree, parents = [5, 6, 7, 8], [ROOT, 0, 1, ROOT]
    choices = [5, 6, 9, 0, 0]  # at the root, then after each node
    out = commit(tree, parents, choices, Response().push)
    assert out.accepted == [0, 1] and out.correction == 9  # 7 was drafted, the target wanted 9
    assert out.tokens == [5, 6, 9] and out.taken == 3 and out.forced == 0


def test_every_draft_accepted_still_commits_the_bonus_token():
    out = commit([5, 6], [ROOT, 0], [5, 6, 4], Response().push)
    assert (out.accepted, out.tokens) == ([0, 1], [5, 6, 4])  # 4: the target's own next token, free


def test_a_rejected_root_commits_the_targets_token_alone():
    out = commit([5, 6], [ROOT, 0], [3, 6, 4], Response().push)
    assert (out.accepted, out.correction, out.tokens) == ([], 3, [3])
    nothing = commit([], [], [7], Response().push)  # AR: no tree, one token
    assert (nothing.accepted, nothing.tokens) == ([], [7])


def test_a_stop_inside_an_accepted_run_cuts_it_there():
    response = Response(stop_at=6)  # e.g. 6 is EOS, or closes the response
    out = commit([5, 6, 7], [ROOT, 0, 1], [5, 6, 7, 8], response.push)
    assert out.accepted == [0, 1, 2]  # the target agreed with all three drafts ...
    assert out.tokens == [5, 6] and response.ids == [5, 6]  # ... but the response ends at 6, as AR's would


def test_a_draft_the_grammar_rejects_is_never_accepted_and_forced_tokens_are_counted():
    vocab = 10
    logits = torch.zeros(3, vocab)  # the target prefers 5 at the root and 6 after it
    logits[0, 5], logits[1, 6], logits[2, 2] = 3.0, 3.0, 1.0
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    allowed[0] = False
    allowed[0, 5] = True  # the grammar allows only 5 at the root: forced
    allowed[1, 6] = False  # ... and forbids 6 after it (say, a key the schema lacks)
    choices = choose(logits, allowed, None)
    assert choices[0] == 5 and choices[1] != 6  # the target's choice among what is allowed
    out = commit([5, 6], [ROOT, 0], choices, Response().push, allowed)
    assert out.accepted == [0] and out.correction == choices[1] and out.correction != 6
    assert out.forced == 1  # the root's 5 was the only token allowed
