"""Lossless: every speculative decoder's tokens equal greedy AR's, and AR equals transformers.

Random tiny models of each family × random prompts × drafters that are always right, always
wrong, random, and a random-init EAGLE-3 head over its own KV.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.proposers.head import HeadDrafter, TreeBudget
from infer.rounds.tree import ROOT
from schemafill.runtime.backends.batch_invariant import BatchInvariant, possible
from schemafill.runtime.drafter import Eagle3Head, HeadConfig
from schemafill.runtime.loading import from_hf_model
from schemafill.runtime.model import rope_tables
from tests.conftest import decode_ar, decode_tree
from tests.runtime.test_runtime import VOCAB, hf_model


class CharTokenizer:
    """The random models write arbitrary ids: decode them as letters (never JSON)."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


class Oracle:
    """Knows AR's answer: proposes its next tokens as a chain, plus a wrong sibling branch."""

    def __init__(self, prompt: list[int], truth: list[int], length: int) -> None:
        self.prompt, self.truth, self.length = prompt, truth, length

    def start(self, capacity: int) -> None:
        pass

    def draft(self, tokens, new_aux):
        done = len(tokens) - len(self.prompt)
        nxt = self.truth[done:done + self.length]
        if not nxt:
            return [], []
        return nxt + [(nxt[0] + 1) % VOCAB], [ROOT] + list(range(len(nxt) - 1)) + [ROOT]


class Wrong(Oracle):
    """Never right: every proposed token differs from AR's at that place."""

    def draft(self, tokens, new_aux):
        done = len(tokens) - len(self.prompt)
        nxt = self.truth[done:done + self.length] or [0]
        return [(t + 1) % VOCAB for t in nxt], [ROOT] + list(range(len(nxt) - 1))


class RandomTree:
    def __init__(self, seed: int, size: int = 6) -> None:
        self.rng, self.size = random.Random(seed), size

    def start(self, capacity: int) -> None:
        pass

    def draft(self, tokens, new_aux):
        parents = [self.rng.randrange(-1, i) for i in range(self.size)]
        # a few draft tokens copied from the sequence so some get accepted by chance
        return [self.rng.choice(tokens[-8:] + [self.rng.randrange(VOCAB)]) for _ in parents], parents


def random_head(target, seed: int) -> Eagle3Head:
    hf = target.hf_config
    torch.manual_seed(seed)
    c = HeadConfig.from_target(hf, draft_vocab_size=VOCAB // 2, aux_layer_ids=list(target.config.aux_layer_ids))
    head = Eagle3Head(c, target.model.embed_tokens, *rope_tables(hf)).eval()
    head.set_vocab(torch.tensor(sorted(random.Random(seed).sample(range(VOCAB), VOCAB // 2))))
    return head


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_decoder_equals_ar_and_ar_equals_transformers(family):
    model = hf_model(family, seed=7)
    target = from_hf_model(model, aux_layer_ids=[1, 2, 3])
    target.hf_config = model.config
    rng = random.Random(1)
    head = random_head(target, seed=5)
    for case in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
        free = decode_ar(target, CharTokenizer(-1), prompt, 24, frozenset())
        with torch.no_grad():  # AR is transformers' greedy search on the same weights
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert free.ids == ref
        assert free.target_calls == len(free.ids)  # prefill + one call per further token
        # an EOS in the middle of the response makes every decoder stop at the same token
        fresh = [t for i, t in enumerate(free.ids) if i >= 8 + case and t not in free.ids[:i]]
        eos = frozenset(fresh[:1]) if case else frozenset()
        tok = CharTokenizer(next(iter(eos)) if eos else -1)
        ar = decode_ar(target, tok, prompt, 24, eos)
        assert len(ar.ids) >= 8
        drafters = {
            "oracle": Oracle(prompt, ar.ids, 4), "wrong": Wrong(prompt, ar.ids, 3), "random": RandomTree(case),
            "head": HeadDrafter(head, TreeBudget(topk=3, depth=3, total=8)),
            "head_wide": HeadDrafter(head, TreeBudget(topk=4, depth=4, total=20)),
        }
        for name, drafter in drafters.items():
            out = decode_tree(target, tok, prompt, 24, eos, drafter, scratch=32)
            assert out.ids == ar.ids, (family, case, name)
            assert out.stop == ar.stop
            if name == "oracle":
                assert out.target_calls < len(ar.ids) / 2  # the always-right drafter really speeds up
            if name == "wrong":
                assert out.target_calls == len(ar.ids)  # the always-wrong one costs exactly AR's calls


class Refusing:
    """A price that finds no level past the first worth drafting, and records what it was asked."""

    def __init__(self) -> None:
        self.asked = []

    def draft_rate(self, q: float) -> float:
        return q

    def level_worth(self, gain: float, ms: float) -> bool:
        self.asked.append((gain, ms))
        return False

    def head_worth(self, ms: float) -> bool:
        return True


class Skipping(Refusing):
    """A price that finds the head itself not worth drafting."""

    def level_worth(self, gain: float, ms: float) -> bool:
        return True

    def head_worth(self, ms: float) -> bool:
        return False


def test_the_head_stops_growing_its_tree_where_a_level_is_not_worth_its_time():
    model = hf_model("llama", seed=7)
    target = from_hf_model(model, aux_layer_ids=[1, 2, 3])
    target.hf_config = model.config
    price = Refusing()
    drafter = HeadDrafter(random_head(target, seed=5), TreeBudget(topk=3, depth=3, total=39), price)  # keeps every node
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    aux = target(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                 torch.ones(len(prompt), len(prompt), dtype=torch.bool).tril()[None], torch.arange(len(prompt))[None],
                 target.new_arena(1, 16)).aux[0]  # [P, 3H]
    drafter.begin(32)
    # a level's time is not known until one is drafted: the second level is, then the price is asked
    deep = drafter.candidates(prompt + [7], aux)
    assert len(deep) == 3 + 9 and drafter.times.level_ms > 0 and len(price.asked) == 1
    drafter.begin(32)
    shallow = drafter.candidates(prompt + [7], aux)
    assert shallow.parents == [ROOT] * 3  # the first level only: the root's top-3
    gain, ms = price.asked[-1]
    assert 0 < gain <= 1.0 and ms == drafter.times.level_ms  # the root's children's chances sum to at most 1
    drafter.price = None
    drafter.begin(32)
    assert len(drafter.candidates(prompt + [7], aux)) == 3 + 9 + 9  # no price: the budget's depth (3 fed a level)


def test_a_head_not_worth_its_time_skips_rounds_and_catches_up_on_all_it_skipped():
    from infer.proposers.head import SKIP_AT_MOST

    model = hf_model("llama", seed=7)
    target = from_hf_model(model, aux_layer_ids=[1, 2, 3])
    target.hf_config = model.config
    head = random_head(target, seed=5)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    aux = target(torch.tensor([tokens]), torch.arange(len(tokens))[None],
                 torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()[None], torch.arange(len(tokens))[None],
                 target.new_arena(1, 32)).aux[0]  # [T, 3H]
    price = Skipping()
    every, skipping = HeadDrafter(head, TreeBudget(2, 2, 6)), HeadDrafter(head, TreeBudget(2, 2, 6), price)
    for d in (every, skipping):
        d.begin(64)
    p = 8  # the prompt; then one committed token a round: round r's features are position p + r - 1's
    trees, drafted = [], 0
    for r in range(SKIP_AT_MOST + 3):
        new = aux[: p] if r == 0 else aux[p + r - 1: p + r]
        expect = every.candidates(tokens[: p + r + 1], new)
        got = skipping.candidates(tokens[: p + r + 1], new)
        trees.append(len(got))
        drafted += skipping.drafted
        assert skipping.drafted == (len(got) > 0)
        if len(got):  # a round it drafts: the same tree as a head that never skipped
            assert (got.tokens, got.parents, got.sources) == (expect.tokens, expect.parents, expect.sources)
    # the launch's first two rounds draft (what a round costs is measured on the second: the
    # first catches up over the whole prompt), then SKIP_AT_MOST skipped rounds, then one to
    # keep measuring
    assert [n > 0 for n in trees] == [True, True] + [False] * SKIP_AT_MOST + [True]
    assert drafted == 3
    # the next request, once the head is measured not worth its time, skips from its first
    # round on (its catch-up over the whole prompt is the dearest forward) — unless SIDE
    # drafts read the prompt's head entries that catch-up writes
    for prompt_first in (False, True):
        nxt = HeadDrafter(head, TreeBudget(2, 2, 6), price, skipping.times, prompt_first=prompt_first)
        nxt.begin(64)
        first = nxt.candidates(tokens[: p + 1], aux[:p])
        assert (len(first) > 0, nxt.forwards > 0) == (prompt_first, prompt_first)
        if not prompt_first:
            for r in range(1, SKIP_AT_MOST + 1):  # the probe catches up on everything skipped
                got = nxt.candidates(tokens[: p + r + 1], aux[p + r - 1: p + r])
            assert len(got) > 0 and nxt.done == p + SKIP_AT_MOST


@pytest.mark.skipif(not possible(torch.bfloat16), reason="no batch-invariant bf16 forward on this host")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_in_bf16_every_decoder_equals_bf16_ar(family):
    """Lossless is relative to AR in the same precision: with batch-invariant forwards a bf16
    verification gives bf16 AR's tokens, where rounding would otherwise part them."""
    model = hf_model(family, seed=7).to(torch.bfloat16)
    target = from_hf_model(model, aux_layer_ids=[1, 2, 3])
    target.hf_config = model.config
    assert isinstance(target.backend, BatchInvariant)
    head = random_head(target, seed=5).to(torch.bfloat16)
    rng = random.Random(2)
    for case in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))]
        ar = decode_ar(target, CharTokenizer(-1), prompt, 32, frozenset())
        drafters = {"oracle": Oracle(prompt, ar.ids, 5), "random": RandomTree(case),
                    "head": HeadDrafter(head, TreeBudget(topk=4, depth=4, total=20))}
        for name, drafter in drafters.items():
            out = decode_tree(target, CharTokenizer(-1), prompt, 32, frozenset(), drafter, scratch=32)
            assert out.ids == ar.ids, (family, case, name)
