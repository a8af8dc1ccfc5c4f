"""The training-free peers: prompt lookup, suffix trees, token recycling and ToolSpec's
retrieval store, retrieval and schema FSM on literal cases; every peer lossless against AR on a random
model (free and constrained, including trees of duplicate tokens from an empty recycling
table) and on the built-in model, where each must also save target calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer.decoders import ngram, suffix, toolspec
from infer.pricing.budget import NodeBudget
from infer.pricing.cost_model import CostModel
from infer.proposers.lookup import copy_match, copy_matches, first_matches, ngram_lookup, text_copies
from infer.proposers.retrieval import RetrievalStore
from infer.proposers.suffix import SuffixProposer
from infer.proposers.suffix_tree import SuffixTree
from infer.proposers.token_recycling import RecyclingTable, template_tree
from infer.proposers.toolspec import SchemaFSM, retrieval_candidates
from infer.rounds.decoding import DecodeOptions, Runtime
from infer.rounds.tree import ROOT, depths
from schemafill.config import NgramConfig, SuffixConfig, ToolSpecConfig
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import HERMES, HERMES3, JSON
from schemafill.runtime.grammar import SchemaGrammars
from schemafill.runtime.loading import generation_eos, load_target, load_tokenizer
from tests.conftest import decode_ar
from tests.decoders.test_schemafill import CASES, args_first_request, base_target, request  # noqa: F401 (a fixture)


# ---------------------------------------------------------------- prompt lookup
def test_copy_match_takes_the_longest_suffix_and_its_last_occurrence():
    source = [1, 2, 3, 9, 2, 3, 4, 5, 6]
    assert copy_match([7, 2, 3], source, length=2)[0] == [4, 5]  # "2 3" last seen before 4 5
    assert copy_match([1, 2, 3], source, length=3)[0] == [9, 2, 3]  # the 3-token suffix wins over "2 3"
    assert copy_match([8, 8], source)[0] == []
    assert copy_match([6], source)[0] == []  # at the very end: nothing follows


def test_a_copy_from_the_response_itself_runs_on_through_its_own_tokens():
    response = [4, 1, 2, 1, 2]  # caught in a loop of period 2
    assert copy_match([9, 9] + response, response, length=5)[0] == [1, 2]  # the source ends there
    assert copy_match([9, 9] + response, response, length=5, overlap=True)[0] == [1, 2, 1, 2, 1]
    assert copy_match([3, 4, 5, 3], [3, 4, 5, 3], length=5, overlap=True)[0] == [4, 5, 3, 4, 5]  # period 3
    assert copy_match([1, 2, 3], [1, 2, 3], length=4, overlap=True)[0] == []  # nothing repeats


def test_a_copy_knows_how_long_its_match_is_and_what_else_followed_the_same_text():
    source = [5, 1, 2, 3, 9, 9, 8, 1, 2, 3, 7, 7, 1, 2, 3, 4]
    # the last "1 2 3" is followed by 4, the one before by 7 7, the first by 9 9 (after a 5)
    assert copy_match([0, 1, 2, 3], source, length=2) == ([4], 3)
    assert copy_match([5, 1, 2, 3], source[:-4], length=2) == ([7, 7], 3)  # 8 before it is not 5: 3 tokens
    assert copy_match([6, 5, 1, 2, 3], source[:6], length=2) == ([9, 9], 4)  # the agreement runs back to the 5
    assert copy_match([6, 6], source) == ([], 0)
    # alternatives: the latest continuation first, then the latest whose first token differs
    assert copy_matches([0, 1, 2, 3], source, length=2) == [([4], 3), ([7, 7], 3)]
    assert copy_matches([0, 1, 2, 3], source, length=2, most=3) == [([4], 3), ([7, 7], 3), ([9, 9], 3)]
    twice = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3]  # the same continuation twice: one alternative only
    assert copy_matches([1, 2, 3], twice, length=1) == [([7], 3)]
    loop = [4, 1, 2, 1, 2, 1, 2]  # a response in a loop agrees far back (capped at ``reach``)
    assert copy_match([9] + loop, loop, length=3, overlap=True, reach=4) == ([1, 2, 1], 4)


def test_text_copies_continue_an_open_value_from_the_requests_text():
    source = 'Fly from Seattle, WA to Boston on "Seaside" tickets: 5000 miles, 30% off.\nOther'
    # the value so far matches at two word starts: the latest first, each copy to a quote
    assert text_copies("Se", source, "string") == [('aside', 2), ("attle, WA to Boston on ", 2)]
    assert text_copies("Sea", source, "string") == [("side", 3), ("ttle, WA to Boston on ", 3)]
    assert text_copies("Seat", source, "string", length=6) == [("tle, W", 4)]
    assert text_copies("to B", source, "string") == [("oston on ", 4)]
    # a number's copy stops at its first character no number has; a word start comes before
    # the inside of a word ("5000" starts one, "30%" too: "0" after "3" in "30" is inside it)
    assert text_copies("50", source, "number") == [("00", 2)]
    assert text_copies("3", source, "number") == [("0", 1)]
    # the longest suffix decides: "xSe" is nowhere, "Se" is; nothing may follow "30%"'s "%"
    assert text_copies("xSe", source, "string") == [("aside", 2), ("attle, WA to Boston on ", 2)]
    assert text_copies("30", source, "number") == []
    assert text_copies("ff.", source, "string") == []  # a line break ends a string's copy
    assert text_copies("", source, "string") == [] and text_copies("zz", source, "string") == []
    # a copy that an earlier one starts with adds nothing to the tree: it is not proposed
    assert text_copies("a", 'a b" a b c', "string") == [(" b c", 1)]
    assert text_copies("a", "a b. a b c", "string", most=1) == [(" b c", 1)]


def test_ngram_lookup_longest_ngram_earliest_occurrence():
    ctx = [5, 1, 2, 7, 1, 2, 8, 3, 1, 2]
    assert ngram_lookup(ctx, 1, 4, 3) == [7, 1, 2]  # "1 2" (3 1 2 occurs nowhere else), first seen before 7
    assert ngram_lookup(ctx, 3, 4, 3) == []  # no earlier 3-gram "3 1 2"
    assert ngram_lookup([4, 4, 4], 1, 2, 5) == [4]  # an occurrence overlapping the tail counts; cut at the end
    assert ngram_lookup([9, 1, 2, 9], 1, 1, 2) == [1, 2]
    assert ngram_lookup([1, 2, 3], 1, 3, 4) == []
    with pytest.raises(ValueError):
        ngram_lookup(ctx, 3, 2, 1)


def test_first_matches_longest_n_first_then_earliest():
    source = [1, 2, 3, 0, 2, 3, 0, 1, 2, 3]
    assert list(first_matches([1, 2, 3], source, 2, 3)) == [3, 3, 6]  # n=3, then n=2; never the source's own end


# ---------------------------------------------------------------- suffix trees
def test_suffix_tree_counts_and_speculates_by_frequency():
    t = SuffixTree(max_depth=4)
    t.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert t.root.count == 9 and t.root.children[1].count == 3
    assert t.root.children[1].children[2].children[3].count == 2
    # tail "1 2" (3 occurrences, one is the tail itself): 3 follows twice (2/3), 4 once (1/3);
    # after "1 2 3" (twice), 1 once: 2/3 * 1/2. Tails "2" and "1 2" score alike: the longer wins
    d = t.speculate([9, 1, 2], max_spec_tokens=8, factor=2.0)
    assert d.tokens == [3, 1] and d.parents == [ROOT, 0] and d.match == 2
    assert d.score == pytest.approx(2 / 3 + 1 / 3)
    wide = t.speculate([9, 1, 2], max_spec_tokens=8, factor=2.0, tree=True, min_token_prob=0.3)
    assert wide.tokens == [3, 4] and wide.parents == [ROOT, ROOT]  # best first: 4 (1/3) ties 1 and came first
    assert t.speculate([9, 1, 2], 8, factor=0.5).tokens == [3]  # m = 1 earns no token, m = 2 one
    assert t.speculate([9, 1, 2], 8, factor=2.0, min_token_prob=0.7).tokens == []
    assert t.speculate([7, 7], 8).tokens == []


def test_suffix_tree_budget_grows_with_the_match():
    t = SuffixTree(max_depth=8)
    t.extend("a", [1, 2, 3, 4, 5, 6])
    t.extend("b", [9, 9, 3])
    assert t.speculate([0, 3], 8, factor=1.0).tokens == [4]  # m = 1 (the whole context is never matched)
    assert t.speculate([0, 2, 3], 8, factor=1.0).tokens == [4, 5]  # m = 2: two tokens, each certain
    assert t.speculate([0, 2, 3], 1, factor=1.0).tokens == [4]  # the cap


def test_suffix_tree_remove_restores_the_counts():
    t = SuffixTree(max_depth=3)
    t.extend("keep", [1, 2, 3])
    before = repr(t.root)
    t.extend("gone", [1, 2, 5, 1])
    t.extend("gone", [2])  # extended in two parts
    t.remove("gone")
    assert repr(t.root) == before and len(t) == 1


def test_suffix_drafter_reads_earlier_responses_and_keeps_prompts_out_of_them():
    cfg = SuffixConfig(max_tree_depth=8, min_token_prob=0.0)
    responses = SuffixTree(8)
    responses.extend("earlier", [4, 5, 6, 7])
    d = SuffixProposer(cfg, responses, "now")
    d.prompt_len = 3  # as ``start`` sets it from the session
    c = d.propose(SimpleNamespace(tokens=[1, 4, 5]))
    assert (c.tokens, c.parents, c.sources) == ([6, 7], [ROOT, 0], ["suffix:1", "suffix:2"])  # only the earlier response knows "4 5"
    assert responses.sequences["now"] == []  # prompt tokens stay out of the response tree
    d.propose(SimpleNamespace(tokens=[1, 4, 5, 8]))
    assert responses.sequences["now"] == [8]


# ---------------------------------------------------------------- token recycling
def test_recycling_template_is_tool_specs_80_node_tree():
    parents, columns = template_tree()
    assert len(parents) == 80
    assert [depths(parents).count(d) for d in range(1, 7)] == [8, 21, 25, 15, 8, 3]
    assert sum(p == ROOT for p in parents) == 8 and columns[:8] == list(range(8))


def test_recycling_table_learns_top_k_and_drafts_through_rows():
    table = RecyclingTable(vocab_size=10, k=2)
    logits = torch.full((2, 10), -1.0)
    logits[0, [4, 6]] = torch.tensor([2.0, 1.0])  # at token 3: 4, then 6
    logits[1, [7, 8]] = torch.tensor([1.0, 3.0])  # at token 4: 8, then 7
    table.update([3, 4], logits)
    assert table.next[3].tolist() == [4, 6] and table.next[4].tolist() == [8, 7]
    parents, columns = [ROOT, ROOT, 0, 0, 2], [0, 1, 0, 1, 0]
    assert table.draft(3, parents, columns) == [4, 6, 8, 7, 0]  # row 8 is unseen: zeros


# ---------------------------------------------------------------- ToolSpec's pieces
def test_retrieval_candidates_take_complete_chains_one_length_per_slot():
    cfg = ToolSpecConfig(ngram_max=3, ngram_min=2, candidates=[3, 2])
    retrieved = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9]
    # "2 3" after "1 2 3": first at 3 (4 5 6), then a prefix of it (4 5 ... no: 4 9 differs)
    # "1 2 3" at 0 (then 4 5 6: slot 1, 3 tokens) and at 6 (then 4 9: slot 2, 2 tokens, not a prefix)
    assert retrieval_candidates([7, 1, 2, 3], retrieved, cfg) == [[4, 5, 6], [4, 9]]
    assert retrieval_candidates([7, 8, 5, 6], retrieved, cfg) == [[1, 2, 3]]  # n = 2 when no 3-gram matches
    same = ToolSpecConfig(ngram_max=3, ngram_min=2, candidates=[2, 2])
    assert retrieval_candidates([7, 1, 2, 3], [1, 2, 3, 4, 5] * 2, same) == [[4, 5]]  # the same chain once
    short = ToolSpecConfig(ngram_max=2, ngram_min=2, candidates=[5])
    assert retrieval_candidates([0, 4, 9], [4, 9, 1], short) == []  # 1 0 4 9 is one token short: dropped


def test_schema_fsm_names_keys_and_separator_rule():
    fsm = SchemaFSM(request("bm25"))
    assert fsm.names()[0] == '{"tool_calls": [{"name": "get_weather'
    fsm.detect('{"tool_calls": [{"name": "get_weath')
    assert fsm.tool is None and fsm.first_keys("x") == ['x", "arguments": {"']
    text = '{"tool_calls": [{"name": "get_weather'
    fsm.detect(text)
    assert fsm.tool == "get_weather"
    assert fsm.first_keys(text) == [text + '", "arguments": {"city": ', text + '", "arguments": {"unit": ']
    typed = text + '", "arguments": {"city": "Oslo", "u'
    assert fsm.next_keys(typed, 'Oslo", "u') == [typed + 'nit": ']
    assert fsm.next_keys(typed, 'Oslo"') == []


def test_schema_fsm_in_hermes3_drafts_keys_first_and_detects_by_keys():
    fsm = SchemaFSM(request("no_params"), HERMES3)  # ping (no keys), get_weather (city, unit)
    head = '<tool_call>\n{"arguments": {'
    assert fsm.names() == [head + '}, "name": "ping', head + '"city": ', head + '"unit": ']
    assert fsm.first_keys("anything") == fsm.names()  # step 1: step 0's chains again
    fsm.detect(head)
    assert fsm.tool is None and fsm.fits == ["ping", "get_weather"]  # no key yet: every tool
    typed = head + '"city": "Oslo", "u'
    assert fsm.next_keys(typed, 'Oslo", "u') == [typed + 'nit": ']  # the keys of the tools that fit
    fsm.detect(head + '"city": "Oslo"')
    assert fsm.tool == "get_weather"  # the only tool with "city"
    closed = head + '"city": "Oslo"}, "n'
    assert fsm.next_keys(closed, 'Oslo"}, "n', in_arguments=False) == [closed + 'ame": "get_weather"}']
    assert fsm.next_keys(closed, 'Oslo"}, "n') == []  # inside the arguments: no key starts so
    fsm = SchemaFSM(request("bm25"), HERMES3)
    fsm.detect(head + '"city": "Oslo"}, "name": "ping"')  # the name, once written, wins
    assert fsm.tool == "ping"
    fsm = SchemaFSM(request("twenty"), HERMES3)
    fsm.detect(head + '"arg_3": 1')
    assert fsm.tool == "tool_3"


def test_store_returns_the_most_similar_outputs_but_never_the_requests_own():
    store = RetrievalStore(k=2)
    store.add("a", torch.tensor([1.0, 0.0]), [1])
    store.add("b", torch.tensor([0.6, 0.8]), [2])
    store.add("c", torch.tensor([0.0, 1.0]), [3])
    store.add("a", torch.tensor([0.0, 1.0]), [99])  # decoded again: the first output stays
    assert store.nearest(torch.tensor([1.0, 0.1]), exclude="x") == [[1], [2]]
    assert store.nearest(torch.tensor([1.0, 0.1]), exclude="a") == [[2], [3]]


# ---------------------------------------------------------------- lossless
def peers(target, tok, eos, max_new, fmt=JSON):
    rt = Runtime(target, tok, eos, max_new, fmt)
    return {"ngram": ngram.declare(rt, NgramConfig()),
            "suffix": suffix.declare(rt, SuffixConfig()),
            "suffix_path": suffix.declare(rt, SuffixConfig(tree=False, min_token_prob=0.0, max_cached_requests=2)),
            "toolspec": toolspec.declare(rt, ToolSpecConfig()),
            # cost-aware selection (decode.select=cost) on a curve steep enough that it prunes
            "ngram_cost": ngram.declare(rt, NgramConfig(), NodeBudget(STEEP)),
            "suffix_cost": suffix.declare(rt, SuffixConfig(), NodeBudget(STEEP)),
            "toolspec_cost": toolspec.declare(rt, ToolSpecConfig(), NodeBudget(STEEP))}


STEEP = CostModel((1, 64), (10.0, 10.0 + 63 * 4.0))  # each row costs 40 % of a one-row step


def test_peers_lossless_on_a_random_model(tiny_target):
    """A random model repeats itself: suffix and n-gram drafts get accepted and rejected at
    every depth; the empty recycling table drafts trees of duplicate tokens (all zeros)."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    grammars = SchemaGrammars(tok, target.config.vocab_size)
    methods = peers(target, tok, eos, 32)
    names = ("bm25", "repeated", "no_params", "twenty")
    for name in names:
        req = request(name)
        ids = prompt_ids(req, "plain", tok)
        ar = decode_ar(target, tok, ids, 32, eos)
        constrained = decode_ar(target, tok, ids, 32, eos, constraint=grammars.constraint(req.functions))
        for method, decoder in methods.items():
            assert decoder.decode(req, ids).ids == ar.ids, (name, method)
            out = decoder.decode(req, ids, DecodeOptions(constraint=grammars.constraint(req.functions)))
            assert out.ids == constrained.ids, (name, method, "constrained")
    assert methods["toolspec"].memory.table.next.any()  # the table learnt from verified nodes
    pruned = methods["toolspec_cost"].budget.stats.table()
    assert sum(v["reached"] for v in pruned.values()) > 0  # it observed what it verified
    assert len(methods["suffix"].memory.responses) == len(names)  # one response per request: the latest decode
    assert list(methods["suffix_path"].memory.responses.sequences) == list(names[-2:])  # the oldest evicted
    assert len(methods["toolspec"].memory.store.ids) == len(names)
    methods["suffix"].reset()
    methods["toolspec"].reset()
    assert len(methods["suffix"].memory.responses) == 0 and not methods["toolspec"].memory.table.next.any()


def test_peers_lossless_in_the_hermes_format(base_target):
    """The built-in model writes ``<tool_call>`` blocks from the hermes prompt: ToolSpec's FSM
    drafts hermes headers and tool names, the others copy; every one equals AR."""
    target, tok, eos = base_target
    # the format reaches each decoder the same way with or without selection: the plain four
    methods = {m: d for m, d in peers(target, tok, eos, 40, HERMES).items()
               if m in ("ngram", "suffix", "toolspec")}
    saved = dict.fromkeys(methods, 0)
    for name in ("wrong_order", "one_tool"):
        ids = prompt_ids(request(name), "plain", tok, fmt=HERMES)
        ar = decode_ar(target, tok, ids, 40, eos, fmt=HERMES)
        assert "<tool_call>" in ar.text
        for method, decoder in methods.items():
            out = decoder.decode(request(name), ids)
            assert out.ids == ar.ids, (name, method)
            saved[method] += ar.target_calls - out.target_calls
    assert all(s > 0 for s in saved.values()), saved
    # the FSM drafts hermes block headers and tool names
    assert saved["toolspec"] > 30, saved


def test_toolspecs_lossless_in_the_hermes3_format(tiny_target, base_target):
    """hermes3 writes a call's arguments before its name: ToolSpec drafts every tool's first
    keys at step 0 and detects the tool by its keys; it equals AR on a random model and on the
    built-in model's args-first block, with selection or without."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    methods = {m: d for m, d in peers(target, tok, eos, 24, HERMES3).items()
               if m in ("toolspec", "toolspec_cost")}
    for name in ("bm25", "no_params", "twenty"):
        ids = prompt_ids(request(name), "plain", tok, fmt=HERMES3)
        ar = decode_ar(target, tok, ids, 24, eos, fmt=HERMES3)
        for method, decoder in methods.items():
            assert decoder.decode(request(name), ids).ids == ar.ids, (name, method)
    target, tok, eos = base_target
    req = args_first_request()
    ids = prompt_ids(req, "plain", tok, fmt=HERMES3)
    ar = decode_ar(target, tok, ids, 32, eos, fmt=HERMES3)
    assert ar.text.startswith('<tool_call>\n{"arguments": {"city": ')
    for method, decoder in peers(target, tok, eos, 32, HERMES3).items():
        if method == "toolspec":
            out = decoder.decode(req, ids)
            assert out.ids == ar.ids, (method, ar.text, out.text)
            assert out.target_calls < ar.target_calls / 4, method


@pytest.mark.slow  # ~3 min on 2 AVX512 cores with nothing else running: `make test-full`
def test_peers_lossless_and_fewer_calls_on_the_builtin_model(builtin_artifacts):
    folder = builtin_artifacts / "targets" / "smollm2-135m-base"
    tok = load_tokenizer(str(folder))
    eos = generation_eos(str(folder), tok)
    target = load_target(folder, torch.float32, torch.device("cpu"), [2, 15, 27], backend="eager")
    methods = peers(target, tok, eos, 48)
    saved = dict.fromkeys(methods, 0)
    for name in CASES:
        ids = prompt_ids(request(name), "plain", tok)
        ar = decode_ar(target, tok, ids, 48, eos)
        for method, decoder in methods.items():
            out = decoder.decode(request(name), ids)
            assert out.ids == ar.ids, (name, method)
            saved[method] += ar.target_calls - out.target_calls
    assert all(s > len(CASES) for s in saved.values()), saved  # each drafts something the target takes
    assert saved["toolspec"] > len(CASES) * 5  # the header, tool names and keys come from the schema FSM
