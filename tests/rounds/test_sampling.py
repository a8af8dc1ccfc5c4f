"""Exact speculative sampling: the sampler on literal cases, and the distribution of complete
outputs of EAGLE-3, SchemaFill and the training-free peers' sampling against AR sampling on a small-vocabulary model,
with a negative control (one draw shared by a whole tree) that the test must reject."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch

from infer.decoders import ngram, slot_parallel, suffix, toolspec
from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel
from infer.proposers.head import HeadDrafter, TreeBudget
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.rounds.sampling import History, Sampler, tree_paths
from infer.rounds.tree import ROOT
from infer.rounds.verify import choose
from infer.slots.policy import SchemaFillConfig
from schemafill.config import NgramConfig, SuffixConfig, ToolSpecConfig
from schemafill.runtime.drafter import Eagle3Head, HeadConfig
from schemafill.runtime.grammar import Constraint
from schemafill.runtime.loading import from_hf_model
from schemafill.runtime.model import rope_tables
from tests.conftest import decode_ar, decode_tree
from tests.decoders.test_schemafill import request
from tests.runtime.test_runtime import hf_model

V = 12  # vocabulary of the model: few enough complete outputs to count
EOS = 0
N = 1500  # samples per decoder


def test_sampler_literal_cases():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert choose(logits, None, Sampler()) == [1, 0]  # temperature 0: argmax
    p = Sampler(temperature=1.0, top_p=0.6).probs(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0]]))  # the nucleus reaching 0.6, renormalised
    a, b = Sampler(1.0, seed=3), Sampler(1.0, seed=3)
    assert [choose(logits, None, a) for _ in range(5)] == [choose(logits, None, b) for _ in range(5)]  # seeded
    draws = Counter(choose(torch.log(torch.tensor([[0.7, 0.2, 0.1]] * 4000)), None, Sampler(1.0, seed=0)))
    assert abs(draws[0] / 4000 - 0.7) < 0.03 and abs(draws[2] / 4000 - 0.1) < 0.02
    with pytest.raises(ValueError):
        Sampler(temperature=-1.0)


def test_bias_and_penalties_literal_cases():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]] * 3)
    history = History(prompt=[3], response=[1, 1], paths=[[], [2], [2, 1]])
    assert tree_paths([2, 1, 0], [ROOT, 0, ROOT]) == [[], [2], [2, 1], [0]]
    out = Sampler(frequency_penalty=0.5, presence_penalty=0.25).adjust(logits, history)
    # token 1 seen twice in the response (three times on row 2's path), token 2 once on rows 1 and 2
    assert torch.allclose(out, torch.tensor([[1.0, 0.75, -1.0, 0.5], [1.0, 0.75, -1.75, 0.5],
                                             [1.0, 0.25, -1.75, 0.5]]))
    out = Sampler(repetition_penalty=2.0).adjust(logits, history)
    # positive logits halved, negative doubled, for tokens of the prompt or the row's response
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, -1.0, 0.25], [1.0, 1.0, -2.0, 0.25],
                                             [1.0, 1.0, -2.0, 0.25]]))
    biased = Sampler(logit_bias=((0, -5.0), (3, 2.0)))
    assert choose(logits, None, biased) == [3, 3, 3]
    assert not Sampler().params.shapes_logits and biased.params.shapes_logits
    with pytest.raises(ValueError, match="history"):
        Sampler(presence_penalty=1.0).adjust(logits)  # a penalty without the tokens before each row
    p = Sampler(1.0, top_k=2).probs(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0]]))
    p = Sampler(1.0, min_p=0.5).probs(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0]]))  # 0.2 < 0.5 * 0.5
    with pytest.raises(ValueError, match="min_p"):
        Sampler(1.0, min_p=1.5)


class TinyTokenizer:
    """Text <-> ids within the model's vocabulary (the packer's JSON becomes in-range ids)."""

    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [1 + ord(c) % (V - 1) for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == EOS))


class Peek:
    """Proposes the target's own two most likely tokens, two levels deep: paths of several
    nodes get accepted often, which is where a wrong rule shows."""

    def __init__(self, model) -> None:
        self.model = model

    def start(self, capacity: int) -> None:
        pass

    @torch.no_grad()
    def draft(self, tokens, new_aux):
        top = self.model(torch.tensor([tokens])).logits[0, -1].topk(2).indices.tolist()
        out, parents = list(top), [ROOT, ROOT]
        for i, t in enumerate(top):
            nxt = self.model(torch.tensor([tokens + [t]])).logits[0, -1].topk(2).indices.tolist()
            out += nxt
            parents += [i, i]
        return out, parents


class SharedDraw(Sampler):
    """Wrong on purpose: one uniform draw reused at every node of a verification."""

    def draw(self, logits):
        p = self.probs(logits).cpu()
        u = torch.rand((), generator=self.generator)
        return [min(int((row.cumsum(0) < u).sum()), row.numel() - 1) for row in p]


def random_head(target, seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    c = HeadConfig.from_target(target.hf_config, draft_vocab_size=V, aux_layer_ids=list(target.config.aux_layer_ids))
    head = Eagle3Head(c, target.model.embed_tokens, *rope_tables(target.hf_config)).eval()
    head.set_vocab(torch.arange(V))
    return head


def outputs(decode, run: int, sampler_cls=Sampler) -> Counter:
    """N complete outputs; each ``run`` uses its own seeds (shared seeds would correlate the
    samples of two decoders and make any two distributions look alike)."""
    return Counter(tuple(decode(sampler_cls(1.0, seed=run * N + i)).ids) for i in range(N))


def same_distribution(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test (outcomes seen < 10 times pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = (sum(a.values()) - sum(a[k] for k in keys), sum(b.values()) - sum(b[k] for k in keys))
    table = torch.tensor([[a[k], b[k]] for k in keys] + [list(rest)], dtype=torch.float64)
    table = table[table.sum(1) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.slow
def test_speculative_sampling_has_ars_distribution():
    model = hf_model("llama", seed=11, vocab_size=V, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # peaked next-token distributions: few distinct outputs
    target = from_hf_model(model, aux_layer_ids=[0, 1, 1])
    target.hf_config = model.config
    tok, eos, prompt, max_new = TinyTokenizer(), frozenset({EOS}), [3, 7, 1, 5], 3
    head = HeadDrafter(random_head(target, seed=2), TreeBudget(topk=3, depth=2, total=8))
    sf = slot_parallel.declare(Runtime(target, tok, eos, max_new), random_head(target, seed=2),
                            SchemaFillConfig(budget=TreeBudget(topk=3, depth=2, total=8)))

    ar = outputs(lambda s: decode_ar(target, tok, prompt, max_new, eos, s), run=0)
    assert 10 < len(ar) < N / 3  # a distribution with mass to compare, not a point or a smear
    peek = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, Peek(model), scratch=8, sampler=s), 1)
    eagle = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, head, scratch=8, sampler=s), 2)
    sf = outputs(lambda s: sf.decode(request("bm25"), prompt, DecodeOptions(sampler=s)), 3)
    # cost-aware selection (decode.select=cost) changes the proposal round by round, from
    # estimates learnt on earlier samples: still AR's distribution
    curve = CostModel((1, 64), (10.0, 73.0))  # a row costs a tenth of a one-row step: some nodes pay, some not
    costed = NodeBudget(curve)
    priced = HeadDrafter(random_head(target, seed=2), TreeBudget(topk=3, depth=2, total=8), costed)  # levels too
    eagle_cost = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, priced, scratch=8, sampler=s,
                                               budget=costed), 9)
    sf_cost = slot_parallel.declare(Runtime(target, tok, eos, max_new), random_head(target, seed=2),
                                 SchemaFillConfig(budget=TreeBudget(topk=3, depth=2, total=8)), NodeBudget(curve))
    sf_costed = outputs(lambda s: sf_cost.decode(request("bm25"), prompt, DecodeOptions(sampler=s)), 10)
    assert sum(v["reached"] for v in costed.stats.table().values()) > 0
    # the training-free peers; each sample is a new request, so the learning ones (suffix's
    # response tree, ToolSpec's table and memory) draft from every earlier sample
    count = itertools.count()
    fresh = lambda: dataclasses.replace(request("bm25"), id=f"sample{next(count)}")  # noqa: E731
    rt = Runtime(target, tok, eos, max_new)
    peers = {"ngram": ngram.declare(rt, NgramConfig(num_speculative_tokens=2)),
             "suffix": suffix.declare(rt, SuffixConfig(min_token_prob=0.0)),
             "toolspec": toolspec.declare(rt, ToolSpecConfig(ngram_min=1))}
    got_peers = {name: outputs(lambda s, d=d: d.decode(fresh(), prompt, DecodeOptions(sampler=s)), 5 + i)
                 for i, (name, d) in enumerate(peers.items())}
    assert len(peers["suffix"].memory.responses) == N and peers["toolspec"].memory.table.next.any()  # they learnt
    for name, got in {"peek": peek, "eagle3": eagle, "schemafill": sf, "eagle3_cost": eagle_cost,
                      "schemafill_cost": sf_costed, **got_peers}.items():
        assert same_distribution(ar, got) > 1e-3, name
    wrong = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, Peek(model), scratch=8, sampler=s),
                    4, SharedDraw)
    assert same_distribution(ar, wrong) < 1e-6  # the test can tell a wrong rule


def tiny_grammar_constraint():
    """A grammar over the tiny vocabulary (token i is the character chr(97 + i), as
    TinyTokenizer decodes it): a first token in b-e, a forced "g", then one in c-l."""
    import xgrammar as xgr

    vocab = [chr(97 + i) for i in range(V)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[EOS])
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_grammar('root ::= [b-e] "g" [c-l]')
    return lambda: Constraint(xgr, grammar, [v.encode() for v in vocab], torch.zeros(2, V, dtype=torch.bool))


@pytest.mark.slow
def test_constrained_speculative_sampling_has_constrained_ars_distribution():
    model = hf_model("llama", seed=11, vocab_size=V, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    target = from_hf_model(model, aux_layer_ids=[0, 1, 1])
    target.hf_config = model.config
    tok, eos, prompt, max_new = TinyTokenizer(), frozenset({EOS}), [3, 7, 1, 5], 3
    constraint = tiny_grammar_constraint()
    head = HeadDrafter(random_head(target, seed=2), TreeBudget(topk=3, depth=2, total=8))
    ar = outputs(lambda s: decode_ar(target, tok, prompt, max_new, eos, s, constraint()), run=5)
    def in_language(o: tuple) -> bool:
        return o[0] in (1, 2, 3, 4) and o[1] == 6 and o[2] >= 2

    assert all(map(in_language, ar)) and 10 < len(ar) < N / 3
    peek = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, Peek(model), scratch=8, sampler=s,
                                         constraint=constraint()), 6)
    eagle = outputs(lambda s: decode_tree(target, tok, prompt, max_new, eos, head, scratch=8, sampler=s,
                                          constraint=constraint()), 7)
    for name, got in {"peek": peek, "eagle3": eagle}.items():
        assert all(map(in_language, got)), name
        assert same_distribution(ar, got) > 1e-3, name
    free = outputs(lambda s: decode_ar(target, tok, prompt, max_new, eos, s), run=8)
    assert same_distribution(ar, free) < 1e-6  # the constraint really reshapes the distribution


PENALTIES = dict(top_k=6, min_p=0.02, frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.3,
                 logit_bias=((3, 1.0), (5, -1.0)))


class PathBlind(Sampler):
    """Wrong on purpose: penalties counted over the committed response only, blind to the
    drafted path above each node (the speculative engines' old bug)."""

    def adjust(self, logits, history=None):
        if history is not None:
            history = History(history.prompt, history.response, [[] for _ in history.paths])
        return super().adjust(logits, history)


def penalised(cls=Sampler, temperature=1.0):
    return lambda seed: cls(temperature, seed=seed, **PENALTIES)


def all_methods(target, tok, eos, prompt, max_new, model):
    """Every method's decode(sampler) on the tiny target: the test drafter, EAGLE-3, SchemaFill,
    and the training-free peers (fresh requests, so the learning ones learn from each)."""
    rt = Runtime(target, tok, eos, max_new)
    head = HeadDrafter(random_head(target, seed=2), TreeBudget(topk=3, depth=2, total=8))
    sf = slot_parallel.declare(rt, random_head(target, seed=2), SchemaFillConfig(budget=TreeBudget(topk=3, depth=2,
                                                                                                  total=8)))
    count = itertools.count()
    fresh = lambda: dataclasses.replace(request("bm25"), id=f"sample{next(count)}")  # noqa: E731
    peers = {"ngram": ngram.declare(rt, NgramConfig(num_speculative_tokens=2)),
             "suffix": suffix.declare(rt, SuffixConfig(min_token_prob=0.0)),
             "toolspec": toolspec.declare(rt, ToolSpecConfig(ngram_min=1))}
    return {"peek": lambda s: decode_tree(target, tok, prompt, max_new, eos, Peek(model), scratch=8, sampler=s),
            "eagle3": lambda s: decode_tree(target, tok, prompt, max_new, eos, head, scratch=8, sampler=s),
            "schemafill": lambda s: sf.decode(request("bm25"), prompt, DecodeOptions(sampler=s)),
            **{name: (lambda s, d=d: d.decode(fresh(), prompt, DecodeOptions(sampler=s))) for name, d in peers.items()}}


def peaked_target(scale: float):
    model = hf_model("llama", seed=11, vocab_size=V, num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    target = from_hf_model(model, aux_layer_ids=[0, 1, 1])
    target.hf_config = model.config
    return model, target


def test_greedy_with_bias_and_penalties_equals_ar_for_every_method():
    model, target = peaked_target(12.0)
    tok, eos, prompt, max_new = TinyTokenizer(), frozenset({EOS}), [3, 7, 1, 5], 8
    no_eos = ((EOS, -100.0),)  # long answers, where repeats are penalised

    def greedy(seed):
        return Sampler(0.0, seed=seed, **dict(PENALTIES, logit_bias=no_eos + PENALTIES["logit_bias"]))

    ar = decode_ar(target, tok, prompt, max_new, eos, greedy(0)).ids
    assert len(ar) == max_new and ar != decode_ar(target, tok, prompt, max_new, eos, Sampler(logit_bias=no_eos)).ids
    for name, decode in all_methods(target, tok, eos, prompt, max_new, model).items():
        assert decode(greedy(0)).ids == ar, name


@pytest.mark.slow
def test_every_sampling_parameter_keeps_ars_distribution():
    """top_k, min_p, the three penalties and logit_bias at once: every method's complete outputs
    are distributed as AR's with the same parameters; penalties blind to the drafted path are not."""
    model, target = peaked_target(6.0)
    tok, eos, prompt, max_new = TinyTokenizer(), frozenset({EOS}), [3, 7, 1, 5], 3

    def outputs_of(decode, run, make=penalised(), n=N):
        return Counter(tuple(decode(make(run * 3 * N + i)).ids) for i in range(n))

    ar = outputs_of(lambda s: decode_ar(target, tok, prompt, max_new, eos, s), 20)
    assert 10 < len(ar) < N / 3
    for i, (name, decode) in enumerate(all_methods(target, tok, eos, prompt, max_new, model).items()):
        assert same_distribution(ar, outputs_of(decode, 21 + i)) > 1e-3, name
    blind = outputs_of(lambda s: decode_tree(target, tok, prompt, max_new, eos, Peek(model), scratch=8, sampler=s),
                       30, penalised(PathBlind), 3 * N)  # more samples: the wrong rule differs only on some paths
    assert same_distribution(ar, blind) < 1e-6  # the test can tell penalties that skip the drafted path
