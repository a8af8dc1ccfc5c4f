"""The commit step of a round, as a pure function: from the target's choice at each verified
MAIN node to the tokens that join the response.

The accepted path is the longest drafted path whose every token equals the target's choice
at its parent (``tree.greedy_accept``); the target's own choice after it is the *bonus*
token (the correction when a draft was rejected). Of these, the response keeps tokens
until its stopping rule fires (``push`` says how many it took), so a decoder that commits
several tokens a round stops at exactly AR's token. Where a grammar constrains the
response, the choices were already made among the tokens it allowed (``verify.choose``),
so a draft it forbids can never be accepted; a kept token the grammar allowed alone counts
as *forced* however it was committed, so AL without forced tokens means the same for every
method. Pure: torch and the tree module only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infer.rounds.tree import greedy_accept


@dataclass(frozen=True)
class Commit:
    accepted: list[int]  # draft nodes on the accepted path, root-most first
    correction: int  # the target's own token after them (the bonus token)
    tokens: list[int]  # what the response took: the accepted drafts, then the bonus, cut where it stopped
    forced: int  # of those, how many the grammar allowed alone

    @property
    def taken(self) -> int:
        return len(self.tokens)


def commit(tree_tokens: list[int], parents: list[int], choices: list[int], push: Callable[..., int],
           allowed: torch.Tensor | None = None, score: Callable[[list[int], list[int]], list] | None = None
           ) -> Commit:
    """``choices``: the target's token at the root and at each node (1 + m of them);
    ``push``: appends tokens to the response and returns how many it took; ``allowed``:
    [1 + m, V] the grammar's tokens at the root and each node, or None; ``score``: given the
    rows (0 the root, 1 + i node i) each proposed token was chosen at and the tokens, their
    logprobs, which ``push`` is given beside them."""
    accepted, correction = greedy_accept(tree_tokens, parents, choices)
    proposed = [tree_tokens[i] for i in accepted] + [correction]
    rows = [0] + [1 + i for i in accepted]
    taken = push(proposed) if score is None else push(proposed, score(rows, proposed))
    forced = 0
    if allowed is not None:
        on_path = allowed[rows][:taken]  # [taken, V]
        forced = int((on_path.sum(-1) == 1).sum())
    return Commit(accepted, correction, proposed[:taken], forced)
