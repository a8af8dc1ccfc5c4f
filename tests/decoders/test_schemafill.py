"""SchemaFill is lossless: its tokens equal greedy AR's whatever the forecast, the head, the
prepared values, the catalog or the response format; and with the right values it needs fewer
target calls."""

from __future__ import annotations

import pytest
import torch

from infer.decoders import slot_parallel
from infer.proposers.head import SCHEMAFILL_BUDGET, HeadDrafter, HeadStep
from infer.rounds.decoding import Runtime
from infer.rounds.tree import ROOT
from infer.slots.policy import SchemaFillConfig, SideLedger
from schemafill.config import DecodeConfig
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import HERMES, HERMES3, JSON
from schemafill.contract.toolcall import ToolRequest, parse_response
from schemafill.runtime.drafter import Eagle3Head, HeadConfig
from schemafill.runtime.loading import generation_eos, load_target, load_tokenizer
from schemafill.runtime.model import rope_tables
from tests.conftest import decode_ar, decode_tree


def tool(name, props=None, required=None, description=""):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props or {}, "required": required or list(props or {})}}}


WEATHER = tool("get_weather", {"city": {"type": "string", "description": "city name"},
                               "unit": {"type": "string", "enum": ["C", "F"]}}, ["city"], "Current weather in a city")
FLIGHT = tool("book_flight", {"route": {"type": "object", "properties": {"from": {"type": "string"},
                                                                          "to": {"type": "string"}}},
                              "passengers": {"type": "array", "items": {"type": "string"}},
                              "seats": {"type": "integer"}}, description="Book a flight")
PING = tool("ping", description="Check the connection")
MANY = [tool(f"tool_{i}", {f"arg_{i}": {"type": "number"}}, description=f"Tool number {i}") for i in range(20)]

CASES = {  # name: (catalog, user text, forced call groups or None for BM25)
    "bm25": ([WEATHER, FLIGHT, PING], "What's the weather in Zürich and in 日本? Use Celsius.", None),
    "wrong_tools": ([WEATHER, FLIGHT, PING], "What's the weather in Paris and Rome?", [2, 1, 2]),
    "wrong_order": ([WEATHER, FLIGHT], "Book a flight from Oslo to Rome for \"Ann\" and Bo, then the weather "
                                       "in Rome.", [0, 1]),
    "repeated": ([WEATHER, FLIGHT], "Weather in Paris, Lyon and Nice.", [0, 0, 0]),
    "no_params": ([PING, WEATHER], "Ping the server, then the weather in Oslo.", [0, 0]),
    "one_tool": ([FLIGHT], "Book 2 seats from Lima to Quito for Ana and Luis.", None),
    "twenty": (MANY, "Run tool 7 with 3.5 and tool 12 with -1.", None),
}


def request(name):
    tools, text, _ = CASES[name]
    return ToolRequest(id=name, messages=[{"role": "user", "content": text}], tools=tools)


# shown this, the built-in model answers a hermes3 prompt with an args-first block
ARGS_FIRST = ('Weather in Oslo, then in Rome. Example reply:\n'
              '<tool_call>\n{"arguments": {"city": "Oslo", "unit": "C"}, "name": "get_weather"}\n</tool_call>\n'
              '<tool_call>\n{"arguments": {"city": "Rome", "unit": "C"}, "name": "get_weather"}\n</tool_call>')


def args_first_request():
    return ToolRequest(id="args_first", messages=[{"role": "user", "content": ARGS_FIRST}],
                       tools=[WEATHER, FLIGHT, PING])


def random_head(target, seed=0):
    torch.manual_seed(seed)
    hf = target.hf_config
    c = HeadConfig.from_target(hf, draft_vocab_size=8192, aux_layer_ids=list(target.config.aux_layer_ids))
    head = Eagle3Head(c, target.model.embed_tokens, *rope_tables(hf)).eval()
    head.set_vocab(torch.arange(8192))
    return head


def oracle_values(text: str, fmt=JSON) -> dict[tuple[int, str], str]:
    """Value literals of AR's own response, where it parses."""
    calls = parse_response(text.strip(), fmt) or []
    from schemafill.contract.response_format import dumps
    return {(j, k): dumps(v) for j, c in enumerate(calls) for k, v in c.arguments.items()}


def check(target, tok, eos, names, ablations, max_new=40, oracle=False, budget=None, fmt=JSON, **limits):
    head = random_head(target)
    for name in names:
        req = request(name)
        ids = prompt_ids(req, "plain", tok, fmt=fmt)
        ar = decode_ar(target, tok, ids, max_new, eos, fmt=fmt)
        groups = CASES[name][2]
        calls = parse_response(ar.text.strip(), fmt) if oracle else None
        if calls:  # the right forecast too: AR's own tools, in its order
            catalog = [fn["name"] for fn in req.functions]
            groups = [catalog.index(c.name) for c in calls if c.name in catalog] or groups
        for ab in ablations:
            sf = slot_parallel.declare(Runtime(target, tok, eos, max_new, fmt), head,
                                    SchemaFillConfig(budget=SCHEMAFILL_BUDGET, ablation=ab, **limits), budget)
            out = sf.decode(req, ids, groups=groups, values=oracle_values(ar.text, fmt) if oracle else None)
            assert out.ids == ar.ids, (name, ab, ar.text, out.text)
            assert out.stop == ar.stop
            if ab == "A" and budget is None:  # EAGLE-3 under SchemaFill's policy is EAGLE-3 (the eval reuses eagle3's row)
                tree = decode_tree(target, tok, ids, max_new, eos, HeadDrafter(head, SCHEMAFILL_BUDGET),
                                   scratch=SCHEMAFILL_BUDGET.total, fmt=fmt)
                assert (tree.target_calls, tree.nodes) == (out.target_calls, out.nodes)
        yield name, ar, out


@pytest.fixture(scope="module")
def base_target(builtin_artifacts):
    """The real built-in model (not fine-tuned): it writes JSON-like tool calls."""
    folder = builtin_artifacts / "targets" / "smollm2-135m-base"
    tok = load_tokenizer(str(folder))
    return load_target(folder, torch.float32, torch.device("cpu"), [2, 15, 27], backend="eager"), tok, generation_eos(str(folder), tok)


def test_schemafill_config_takes_every_setting_decode_names():
    d = DecodeConfig(topk=2, depth=3, total_tokens=5, forecast_budget=2, ablation="C", side_depth=0,
                     pack_provisional=False, side_optional=False, copy_len=0, chain_head_depth=1)
    c = SchemaFillConfig.of(d)
    assert (c.budget.topk, c.budget.depth, c.budget.total) == (2, 3, 5)
    assert (c.forecast_budget, c.ablation, c.side_depth, c.pack_provisional, c.side_optional, c.copy_len,
            c.chain_head_depth) == (2, "C", 0, False, False, 0, 1)
    assert c.max_branches == SchemaFillConfig.max_branches  # not a decode setting: the default
    assert SchemaFillConfig.of(d, ablation="A").ablation == "A"
    with pytest.raises(ValueError, match="decode.ablation"):
        SchemaFillConfig.of(d, ablation="E")


def test_random_model_every_ablation_equals_ar(tiny_target):
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    for _ in check(target, tok, eos, ["bm25", "twenty"], "ABCD", max_new=24):
        pass
    # branches retired after a few tokens: the SIDE pool reuses freed rows out of order
    for _ in check(target, tok, eos, ["repeated"], "CD", max_new=24, max_value_tokens=2, max_branches=3):
        pass


def test_cost_aware_rounds_equal_ar_whatever_they_keep(tiny_target, base_target):
    """Selection changes only the proposal: on a steep curve it drops MAIN nodes and SIDE steps
    (and their head drafts), on a flat one it keeps them; AR's tokens either way."""
    from infer.pricing.budget import NodeBudget
    from infer.pricing.cost_model import CostModel

    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    steep, flat = CostModel((1, 64), (10.0, 262.0)), CostModel((1, 64), (10.0, 10.5))
    for curve in (steep, flat):
        for guess in (False, True):  # guessed ends and values, and the response's end: proposals only
            for _ in check(target, tok, eos, ["bm25", "repeated"], "BD", max_new=24, budget=NodeBudget(curve),
                           guess_ends=guess, value_guesses=3 * guess):
                pass
    target, tok, eos = base_target
    budget = NodeBudget(steep)
    for name, ar, out in check(target, tok, eos, ["wrong_order"], "D", max_new=48, oracle=True, budget=budget):
        assert out.target_calls < ar.target_calls / 2  # measured: 9 calls for AR's 48 tokens
    assert budget.stats.table()  # it learnt from what it verified


def test_side_contexts_wait_while_side_rows_do_not_pay(base_target):
    """Once a launch has measured that SIDE rows return less than a row costs, no new SIDE
    context opens (at initialisation or later) and no SIDE row is verified: AR's tokens."""
    from infer.pricing.budget import NodeBudget
    from infer.pricing.cost_model import CostModel

    target, tok, eos = base_target
    req = request("wrong_order")
    ids = prompt_ids(req, "plain", tok)
    ar = decode_ar(target, tok, ids, 48, eos)
    init = {}
    for pays in (True, False):
        budget, ledger = NodeBudget(CostModel((1, 64), (10.0, 262.0))), SideLedger()  # 4 ms a row
        if not pays:  # what a launch measured: 1,000 SIDE rows, no token from them, rounds promising 0.1 a ms
            ledger.rows, budget.rate = 1000, 0.1
        sf = slot_parallel.declare(Runtime(target, tok, eos, 48), random_head(target),
                                SchemaFillConfig(budget=SCHEMAFILL_BUDGET, ablation="D", guess_ends=True), budget,
                                ledger)
        out = sf.decode(req, ids, groups=CASES["wrong_order"][2])
        assert out.ids == ar.ids
        init[pays] = out.init_nodes
        if not pays:
            assert ledger.rows == 1000 and ledger.per_row < 0.01
    assert init[False] < init[True]  # the first SIDE prefixes went with the prompt only while they paid


def test_a_shallower_head_beside_a_packed_chain_is_lossless_and_drafts_one_level(base_target):
    """``chain_head_depth=1``: in rounds where the packer has a chain, the head drafts only its
    root's children (one forward fewer per level); AR's tokens either way, fewer nodes."""
    target, tok, eos = base_target
    nodes = {}
    for depth in (0, 1):
        # the built-in model writes hermes blocks from the hermes prompt: the packer has chains
        for name, ar, out in check(target, tok, eos, ["one_tool", "wrong_order"], "D", max_new=48, fmt=HERMES,
                                   chain_head_depth=depth):
            nodes[depth] = nodes.get(depth, 0) + sum(out.nodes)
    assert nodes[1] < nodes[0]
    drafter = HeadDrafter(random_head(target), SCHEMAFILL_BUDGET)
    ids = prompt_ids(request("bm25"), "plain", tok)
    drafter.begin(len(ids) + 4)
    aux = torch.randn(len(ids) - 1, 3 * target.config.hidden_size)
    tree, parents, _ = drafter.scored(ids, aux, depth=1)
    assert len(tree) == SCHEMAFILL_BUDGET.topk and parents == [ROOT] * SCHEMAFILL_BUDGET.topk


def test_builtin_model_with_prepared_values_is_lossless_and_fewer_calls(base_target):
    target, tok, eos = base_target
    saved = []
    for name, ar, out in check(target, tok, eos, ["bm25", "wrong_order"], "D", max_new=48, oracle=True):
        saved.append(ar.target_calls - out.target_calls)
    assert max(saved) >= 15  # the right forecast and values, packed across fields and calls (measured: 20 of 48)


def test_hermes_format_is_lossless_and_packs_its_blocks(tiny_target, base_target):
    """In the hermes format: a random model (never a block), and the built-in model, which
    writes ``<tool_call>`` blocks from the hermes prompt, so the packer's hermes bridges and
    the SIDE branches' hermes contexts are proposed, taken and refused."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    for _ in check(target, tok, frozenset({tok.eos_token_id}), ["bm25", "repeated"], "BD", max_new=24, fmt=HERMES):
        pass
    target, tok, eos = base_target
    saved = 0
    for name, ar, out in check(target, tok, eos, ["wrong_order", "one_tool"], "CD", max_new=48, fmt=HERMES):
        assert "<tool_call>" in ar.text  # the base model answers in blocks here
        saved += ar.target_calls - out.target_calls
    assert saved >= 30  # block headers, names and keys come packed (measured: 66 calls over 4 decodes of 48 tokens)


def test_hermes3_format_is_lossless_and_follows_the_keys_to_the_name(tiny_target, base_target):
    """hermes3 writes a call's arguments before its name. A random model: AR's tokens at
    stages B and D. The built-in model, shown an example, writes an args-first block; with a
    wrong first forecast the plan follows the keys MAIN writes (to a later group's tool, or
    the one catalog tool that holds them), so the packer's keys, closing and name come about
    as cheaply as with the right forecast."""
    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    for _ in check(target, tok, frozenset({tok.eos_token_id}), ["bm25", "repeated"], "BD", max_new=24, fmt=HERMES3):
        pass
    target, tok, eos = base_target
    req = args_first_request()
    ids = prompt_ids(req, "plain", tok, fmt=HERMES3)
    ar = decode_ar(target, tok, ids, 32, eos, fmt=HERMES3)
    assert ar.text.startswith('<tool_call>\n{"arguments": {"city": "Oslo", "unit": "C"}, "name": "get_weather"}')
    head, calls = random_head(target), {}
    for groups in ([0], [1, 0], [2]):  # right; get_weather a later group; only in the catalog
        # no prompt-lookup copies: the example would give the block away whatever the plans
        sf = slot_parallel.declare(Runtime(target, tok, eos, 32, HERMES3), head,
                                SchemaFillConfig(budget=SCHEMAFILL_BUDGET, copy_len=0))
        out = sf.decode(req, ids, groups=groups)
        assert out.ids == ar.ids, (groups, ar.text, out.text)
        calls[groups[0]] = out.target_calls
    # measured 6, 6 and 8 calls of AR's 32 (14 and 18 with the wrong plans kept to the name)
    assert max(calls.values()) <= calls[0] + 3 and calls[0] <= 8, calls


@pytest.mark.slow
def test_builtin_model_adversarial_forecasts_are_lossless(base_target):
    target, tok, eos = base_target
    # with guesses of unprepared values too: wrong forecasts make wrong guesses
    for _ in check(target, tok, eos, list(CASES), "BCD", max_new=48, value_guesses=3):
        pass


def test_sibling_branches_share_one_trunk(smol_tokenizer):
    from infer.slots.side import Branch, SideContexts, ordinal_hint
    from schemafill.contract.response_format import JSON, dumps

    HEADER = JSON.header

    tok = smol_tokenizer
    contexts = SideContexts(tok, prompt_len=5, base=100, size=200)
    branches = [Branch(call=1, tool="get_weather", field=f, hint=ordinal_hint(1),
                       header=HEADER + JSON.call_header("get_weather") + dumps(f) + ":") for f in ("city", "unit", "days")]
    opened = [contexts.open(b) for b in branches]
    assert [len(s) for s in opened] == [2, 1, 1]  # the trunk is computed once, with the first branch
    trunk = opened[0][0]
    for b, segments in zip(branches, opened):
        own = segments[-1]
        # each branch still sees exactly its own tokenisation, at consecutive positions
        assert trunk.tokens + own.tokens == tok(b.hint + b.header, add_special_tokens=False).input_ids
        assert own.positions == list(range(5 + len(trunk.tokens), 5 + len(trunk.tokens) + len(own.tokens)))
        assert own.visible[-1] == list(range(5)) + b.trunk.slots + b.slots
    b = branches[1]
    b.pending, b.draft = 42, 43
    assert contexts.reserve(b, depth=1)
    step = contexts.step(b)
    n = 5 + len(trunk.tokens) + len(b.slots)  # the pending token's position
    assert step.tokens == [42, 43] and step.positions == [n, n + 1]
    assert step.visible[0][-1] == step.slots[0] and step.visible[1] == step.visible[0] + [step.slots[1]]
    aux = torch.zeros(2, 3)
    contexts.settle(b, [43, 7], aux)  # the target chose the draft: both join, 7 comes next
    assert b.tokens[-2:] == [42, 43] and b.value == [42, 43] and b.pending == 7 and not b.reserved
    b.draft = 9
    contexts.reserve(b, depth=1)
    contexts.step(b)
    free = len(contexts.pool.free)
    contexts.settle(b, [8, 1], aux)  # the draft was wrong: the pending token joins, the draft's row is freed
    assert b.value == [42, 43, 7] and b.pending == 8 and len(contexts.pool.free) == free + 1
    for b in branches:
        contexts.free(b)
    assert not contexts.trunks and sorted(contexts.pool.free) == list(range(100, 300))  # nothing leaks


def test_hermes3_branches_serve_any_tool_with_their_key(smol_tokenizer):
    """A hermes3 SIDE context ends before the call's name: branches of one call share a trunk
    whatever their tool, and a branch stays (for the new tool) when its plan is rebound to a
    tool with its key; in hermes its context names the old tool, and it retires."""
    from infer.slots.packer import CallPlan
    from infer.slots.side import Branch, SideBranches, SideContexts

    for fmt in (HERMES3, HERMES):
        contexts = SideContexts(smol_tokenizer, prompt_len=5, base=100, size=200, fmt=fmt)
        side = SideBranches(smol_tokenizer, frozenset({0}), contexts, 4, 8, False, 0, fmt)
        plans = [CallPlan("get_time", ("city",), ("city", "tz"), {}), CallPlan("get_weather", ("city",), ("city",), {})]
        side.open_first(plans)
        assert [(b.call, b.tool, b.field) for b in side.branches] == [(0, "get_time", "city"),
                                                                     (1, "get_weather", "city")]
        other = Branch(call=0, tool="book_flight", field="seats", hint="",
                       header=fmt.field_prefix("book_flight", "seats"))
        assert len(contexts.open(other)) == (1 if fmt is HERMES3 else 2)  # hermes3: get_time's trunk
        contexts.free(other)
        plans[0] = CallPlan("get_weather", ("city",), ("city", "unit"), {})
        side.retire_stale(plans, 0, set())
        if fmt is HERMES3:
            assert [(b.call, b.tool) for b in side.branches] == [(0, "get_weather"), (1, "get_weather")]
        else:
            assert [(b.call, b.tool) for b in side.branches] == [(1, "get_weather")]
        side.retire_stale([CallPlan("ping", (), (), {})] * 2, 0, set())  # no such key: retired in both
        assert not side.branches and not contexts.trunks


def test_side_head_draft_equals_mains_draft_in_the_same_context(tiny_target):
    """The head's entries for a SIDE context (a trunk, then the branch's own tokens, then its
    pending token) give the same draft as MAIN's drafter when MAIN's text is that context."""
    from infer.proposers.head import HeadDrafter, TreeBudget
    from infer.rounds.session import MainSession
    from infer.slots.side import Branch, SideContexts, Trunk
    from schemafill.contract.stopping import ResponseStop

    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    head = random_head(target, seed=4)
    prompt = tok("Call the tool for Oslo.", add_special_tokens=False).input_ids
    context = tok('{"tool_calls": [{"name": "get_weather", "arguments": {"city":', add_special_tokens=False).input_ids
    top1 = TreeBudget(topk=1, depth=1, total=1)

    # reference: the context is part of the prompt; the pending token is the target's next
    # one; training-time test step 0 at the context's last position is the head's output there
    ref = MainSession(target, prompt + context, ResponseStop(tok, eos, 8), scratch=4)
    ref.prefill()
    n = len(prompt + context)
    ids = torch.tensor([ref.tokens[: n + 1]])
    aux = torch.cat([ref.new_aux[:n], torch.zeros_like(ref.new_aux[:1])])[None]  # position n: not seen at n - 1
    with torch.inference_mode():
        expected = head.ttt_forward(ids, aux, torch.ones(1, n + 1, dtype=torch.bool), 1)[0][0, n - 1]
    main = HeadDrafter(head, top1)
    main.begin(n + 9)
    with torch.inference_mode():
        top1_expected = [head.draft_to_target[head.logits(expected).argmax()].item()]
    assert main.scored(ref.tokens, ref.new_aux)[0] == top1_expected

    # SIDE: the same context as a trunk plus the branch's own tokens, beside an empty MAIN
    s = MainSession(target, prompt, ResponseStop(tok, eos, 8), scratch=4, side_capacity=64)
    contexts = SideContexts(tok, len(prompt), s.side_base, 64)
    trunk = Trunk(context[:5], contexts.pool.take(5), branches=1)
    contexts.trunks[tuple(trunk.ids)] = trunk
    b = Branch(call=0, tool="get_weather", field="city", hint="", header="", trunk=trunk,
               tokens=context[5:], slots=contexts.pool.take(len(context) - 5))
    segments = [contexts._segment(trunk.ids, 0, [], trunk.slots),
                contexts._segment(b.tokens, 5, trunk.slots, b.slots)]
    v = s.prefill(extra=segments)
    for owner, choices, aux in zip([trunk, b], v.extra_choices, v.extra_aux):
        contexts.settle(owner, choices, aux)
    assert b.pending == ref.tokens[-1]  # the target's own next token in that context
    side = HeadDrafter(head, top1)
    side.begin(len(prompt) + 9, s.side_base + 64)
    side.scored(s.tokens, s.new_aux)  # MAIN's catch-up writes the prompt's head entries
    assert contexts.reserve(b, depth=1)
    entries, want = contexts.head_entries([b], s.prompt_aux)
    assert len(entries[0]) == len(context) + 1  # every trunk and own entry, then the pending one
    steps = side.entry_steps(*entries, want)
    result = HeadStep.run_together([next(steps)])[0]
    assert result.out.shape[0] == len(set(want))  # outputs of the entries drafted from; the rest write KV only
    assert torch.allclose(result.out[sorted(set(want)).index(want[0])], expected, atol=1e-4)
    with pytest.raises(StopIteration) as done:
        steps.send(result)
    assert done.value.value == top1_expected  # the draft after the pending token, from that output


@pytest.mark.slow  # 70-115 s on 2 AVX2 cores: `make test-full`
def test_builtin_model_prompt_lookup_copies_are_lossless_and_save_calls(base_target):
    """Values copied from the request: MAIN's prompt-lookup chains cut target calls, output unchanged."""
    target, tok, eos = base_target
    names = ["one_tool", "repeated"]
    calls = {n: [out.target_calls for _, _, out in check(target, tok, eos, names, "B", max_new=48, copy_len=n)]
             for n in (0, 4)}
    assert sum(calls[4]) < sum(calls[0]), calls


def test_a_side_context_is_decided_only_at_its_last_node(tiny_target):
    """A new SIDE context's trunk and prefix need the target's features but its choice only at
    the last node (the value's start): the LM head skips the others, and nothing else changes."""
    from infer.rounds.call import Segment
    from infer.rounds.session import MainSession
    from schemafill.contract.stopping import ResponseStop

    target = load_target(tiny_target, torch.float32, torch.device("cpu"), [1, 2, 3], backend="eager")
    tok = load_tokenizer(str(tiny_target))
    eos = frozenset({tok.eos_token_id})
    prompt = tok("Call the tool for Oslo.", add_special_tokens=False).input_ids
    context = tok('{"tool_calls": [{"name": "get_weather", "arguments": {"city":', add_special_tokens=False).input_ids
    p, base = len(prompt), len(prompt) + 8 + 4 + 1  # the SIDE pool of a session with scratch 4 and cap 8

    def prefill(decides):
        s = MainSession(target, prompt, ResponseStop(tok, eos, 8), scratch=4, side_capacity=64)
        assert s.side_base == base
        slots = list(range(base, base + len(context)))
        seg = Segment(context, list(range(p, p + len(context))), slots,
                      [list(range(p)) + slots[: i + 1] for i in range(len(context))], decides=decides)
        return s.prefill(extra=[seg])

    every, last = prefill(None), prefill(1)
    assert len(every.extra_choices[0]) == len(context) and last.extra_choices[0] == every.extra_choices[0][-1:]
    assert torch.allclose(every.extra_aux[0], last.extra_aux[0]) and every.correction == last.correction
    assert prefill(0).extra_choices == [[]]
