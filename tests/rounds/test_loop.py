"""The one round loop on a tiny random target: the order of a method's steps, what the prefill
carries, and AR's tokens whatever a policy proposes."""

from __future__ import annotations

import torch

from infer.rounds import loop
from infer.rounds.candidates import Candidates
from infer.rounds.decoding import DecodeOptions, Runtime
from schemafill.runtime.loading import load_target, load_tokenizer
from tests.conftest import decode_ar


class Recording(loop.Drafting):
    """Proposes the next ``k`` tokens of a known continuation (``truth``), shifted by ``wrong``
    (0: always right), and records every step the loop asks of it."""

    def __init__(self, prompt: list[int], truth: list[int], k: int = 3, wrong: int = 0) -> None:
        super().__init__()
        self.prompt, self.truth, self.k, self.wrong = prompt, truth, k, wrong
        self.scratch = k
        self.steps: list[str] = []

    def _next(self, s) -> Candidates:
        done = len(s.tokens) - len(self.prompt)  # response tokens committed, the pending one included
        return Candidates.chain([t + self.wrong for t in self.truth[done: done + self.k]], "oracle")

    def start(self, s, phases):
        self.steps.append("start")

    def first(self, s):
        self.steps.append("first")
        return loop.Proposal(Candidates.chain([t + self.wrong for t in self.truth[:2]], "oracle"))

    def draft(self, s):
        self.steps.append("draft")
        return loop.Proposal(self._next(s))

    def select(self, s, p, share=loop.ALONE, offer=None):
        self.steps.append("select")
        return super().select(s, p, share, offer)

    def observe(self, s, p, v):
        self.steps.append("observe")

    def settle(self, s, p, v):
        self.steps.append("settle")

    def finish(self, s):
        self.steps.append("finish")
        return {"head_forwards": 7}


def test_the_loop_runs_each_step_in_order_and_keeps_ar_tokens(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    prompt = tok("Call a tool, please.", add_special_tokens=False).input_ids
    ar = decode_ar(target, tok, prompt, 24, eos)
    rt = Runtime(target, tok, eos, 24)

    right = Recording(prompt, ar.ids)
    out = loop.decode(rt, prompt, DecodeOptions(), right)
    assert out.ids == ar.ids and out.target_calls < ar.target_calls  # the oracle's drafts are taken
    assert out.init_nodes == 2 and out.head_forwards == 7  # the prefill's tree; finish's fields
    rounds = out.target_calls - 1
    assert right.steps == ["start", "first", "settle"] + ["draft", "select", "observe", "settle"] * rounds + ["finish"]
    assert set(out.times) >= {"initialisation", "drafting", "verification", "other"}

    wrong = Recording(prompt, ar.ids, wrong=1)  # every draft off by one: nothing accepted
    out = loop.decode(rt, prompt, DecodeOptions(), wrong)
    assert out.ids == ar.ids and out.target_calls == ar.target_calls
    assert max(out.nodes) == 3  # what it proposed was verified, and rejected


def test_ar_is_the_policy_that_proposes_nothing(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    prompt = tok("Hello", add_special_tokens=False).input_ids
    out = loop.decode(Runtime(target, tok, frozenset(), 10), prompt, DecodeOptions(), loop.Drafting())
    assert len(out.ids) == 10 and out.stop == "length"
    assert out.target_calls == 10 and out.nodes == [0] * 10  # the prefill gives the first token
