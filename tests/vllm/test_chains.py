"""SchemaFill's chain drafting from token ids alone (what the vLLM proposer runs), on the
built-in tokenizer and prompts rendered as the pipeline renders them."""

from __future__ import annotations

from collections import deque

import pytest

from infer.vllm.chains import ChainDrafter, asked_format, catalog
from infer.vllm.proposer import SchemaFillProposer, response_format
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import HERMES, JSON
from tests.decoders.test_schemafill import request


@pytest.fixture(scope="module")
def drafter(smol_tokenizer):
    return ChainDrafter(smol_tokenizer)


def after(tok, name: str, response: str, style: str = "plain", fmt=HERMES) -> list[int]:
    """A request's tokens: its prompt, then ``response`` as the target would have written it."""
    return prompt_ids(request(name), style, tok, fmt=fmt) + tok(response, add_special_tokens=False).input_ids


def drafted(drafter, tokens: list[int], k: int = 32) -> str:
    return drafter.tokenizer.decode(drafter.draft(tokens, k))


def test_the_response_starts_with_the_forecast_tools_call_up_to_its_first_value(drafter, smol_tokenizer):
    # BM25 ranks get_weather first for a weather question; its city is a string: its quote is structure
    assert drafted(drafter, after(smol_tokenizer, "bm25", "")) == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    assert len(drafter.draft(after(smol_tokenizer, "bm25", ""), 3)) == 3  # at most k


def test_structure_after_a_tool_name_the_response_chose(drafter, smol_tokenizer):
    # the forecast said get_weather; the response named book_flight: its plan takes over
    tokens = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "book_flight", "arguments": {')
    assert drafted(drafter, tokens) == '"route":'
    tokens = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"')
    assert drafted(drafter, tokens).startswith('}}\n</tool_call>')  # city is the one required key: the call closes


def test_a_value_is_copied_from_the_request_then_closed_and_the_structure_follows(drafter, smol_tokenizer):
    # "Zür" is not a token of " Zürich" in the request: the copy is matched as text
    tokens = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zür')
    assert drafted(drafter, tokens).startswith('ich"}}\n</tool_call>')
    # a value the conversation does not have: nothing guessed
    tokens = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Qx')
    assert drafted(drafter, tokens) == ""


def test_a_chat_template_prompt_and_the_json_format(drafter, smol_tokenizer):
    tokens = after(smol_tokenizer, "bm25", "", style="chat", fmt=JSON)
    assert drafted(drafter, tokens) == '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "'


def test_a_response_gone_off_its_format_is_drafted_from_its_own_repetition(drafter, smol_tokenizer):
    # a small target looping inside a value: the JSON broke at the second quote, the loop goes on
    loop = 'The city, e.g., "'
    tokens = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + loop * 3)
    chain, kind = drafter.draft_tagged(tokens, 8)
    assert (loop * 2).startswith(smol_tokenizer.decode(chain))  # the loop's next turn
    assert len(chain) == 8 and kind == "copy_response16"  # the whole loop agrees with what came before


def test_no_tool_call_no_draft(drafter, smol_tokenizer):
    assert drafter.draft(after(smol_tokenizer, "bm25", "Sorry, I cannot"), 8) == []  # a reply in words
    no_tools = smol_tokenizer("User: hello\n\nResponse:\n", add_special_tokens=False).input_ids
    assert drafter.draft(no_tools, 8) == []  # no catalog in the prompt
    assert drafter.draft(smol_tokenizer("just text", add_special_tokens=False).input_ids, 8) == []  # no marker


def test_requests_interleaved_draft_what_each_drafts_alone(smol_tokenizer):
    a = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "book_flight", "arguments": {')
    b = after(smol_tokenizer, "one_tool", '<tool_call>\n{"name": "book_flight", "arguments": {"route": {"from": "Li')
    alone = [ChainDrafter(smol_tokenizer).draft(t, 8) for t in (a, b)]
    shared = ChainDrafter(smol_tokenizer, cache=1)  # each prompt evicts the other
    assert [shared.draft(t, 8) for t in (a, b, a, b)] == alone * 2


def test_a_reading_advanced_token_by_token_drafts_what_a_fresh_read_drafts(smol_tokenizer):
    # "é" and "€" split into byte tokens: the text's tail is revised as they complete
    response = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "café € 5"}}\n</tool_call>'
    tokens = after(smol_tokenizer, "bm25", response)
    start = len(after(smol_tokenizer, "bm25", ""))
    incremental, fresh = ChainDrafter(smol_tokenizer), ChainDrafter(smol_tokenizer)
    held, steps = None, 0
    for n in list(range(start, len(tokens) + 1)) + [len(tokens)]:  # one token a step, then none
        held = incremental.read(tokens[:n], held)
        alone = fresh.read(tokens[:n])
        assert (held.start, held.key, held.text) == (alone.start, alone.key, alone.text)
        assert held.parser.state == alone.parser.state
        assert incremental.draft_tagged(tokens[:n], 8, held) == fresh.draft_tagged(tokens[:n], 8)
        steps += 1
    assert held.text == response and steps == len(tokens) - start + 2
    # tokens that do not extend what was read (another request): read afresh
    other = after(smol_tokenizer, "one_tool", '<tool_call>\n{"name": "book_flight", "arguments": {')
    assert incremental.read(other, held).key == fresh.read(other).key != held.key
    assert incremental.draft(other, 8) == fresh.draft(other, 8) != []
    # a later generation marker starts a new response
    again = tokens + incremental.markers[0]
    renewed = incremental.read(again, held)
    assert renewed.start == fresh.read(again).start == len(again) and renewed.text == ""


def test_the_proposer_follows_requests_that_move_or_repeat_in_vllms_batch(builtin_artifacts, smol_tokenizer):
    import numpy as np

    a = after(smol_tokenizer, "bm25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zür')
    b = after(smol_tokenizer, "one_tool", '<tool_call>\n{"name": "book_flight", "arguments": {')
    ahead = {0: smol_tokenizer('ich"}}', add_special_tokens=False).input_ids,
             1: smol_tokenizer('"route":', add_special_tokens=False).input_ids}
    proposer = SchemaFillProposer(_Config(str(builtin_artifacts / "targets" / "smollm2-135m-base"), 4, 4096))
    fresh = ChainDrafter(smol_tokenizer)
    rows = [a, b, a]  # two requests alike: each row's parse goes on by itself
    for step in range(3):
        ids = np.zeros((len(rows), 4096), dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        drafts = proposer.propose([[r[-1]] for r in rows], np.array([len(r) for r in rows]), ids)
        assert drafts == [fresh.draft(r, 4) for r in rows]
        # one more token each, and the batch reordered (vLLM condenses rows as requests end)
        rows = [r + [ahead[0 if r[:len(a)] == a else 1][step]] for r in rows][::-1]


def test_the_proposer_stops_drafting_what_does_not_pay_at_the_batchs_rate(builtin_artifacts, smol_tokenizer):
    import numpy as np

    from infer.rounds.backoff import PRIOR_ROUNDS, PROBE_EVERY

    row = after(smol_tokenizer, "bm25", "")
    ids = np.zeros((1, 4096), dtype=np.int32)
    ids[0, :len(row)] = row
    proposer = SchemaFillProposer(_Config(str(builtin_artifacts / "targets" / "smollm2-135m-base"), 4, 4096))
    # rows unpriced (no step remembered): the steps here are back to back, timed with whatever
    # else the host runs, and what a fit of them keeps is the pricing's business, not the back-off's
    proposer.pricing.points = deque(maxlen=0)
    for _ in range(PRIOR_ROUNDS):  # the launch measured drafting that added a token a step for 2 ms
        proposer.launch.drafted(2, 2.0)
    assert proposer.propose([[1]], np.array([len(row)]), ids) != [[]]  # no rate measured yet: it drafts
    proposer.rate.rate = 1.0  # a batch committing a token a millisecond: 2 ms of drafting cost 2 tokens
    # (the steps below, back to back, measure a faster batch still)
    skipped = [proposer.propose([[1]], np.array([len(row)]), ids) for _ in range(PROBE_EVERY - 1)]
    assert skipped == [[[]]] * (PROBE_EVERY - 1)
    assert proposer.propose([[1]], np.array([len(row)]), ids) != [[]]  # a probe
    proposer.rate.rate, proposer.last = 1e-4, None  # the batch thinned out (no step since): drafting pays again
    assert proposer.propose([[1]], np.array([len(row)]), ids) != [[]]


def test_catalog_and_format_are_read_from_the_prompt_text():
    text = 'tools:\n{"name":"f","parameters":{"type":"object"}}\nnot json {"name": 3}\n' \
           '{"type": "function", "function": {"name": "g", "parameters": {}}}'
    functions, spans = catalog(text)
    assert [f["name"] for f in functions] == ["f", "g"] and len(spans) == 2
    assert asked_format(f"reply in this format:\n{JSON.template}") is JSON
    assert asked_format("one <tool_call> block per call") is HERMES


class _Config:
    """The parts of vLLM's ``VllmConfig`` the proposer reads."""

    def __init__(self, tokenizer: str, k: int, max_model_len: int) -> None:
        self.model_config = type("M", (), {"tokenizer": tokenizer, "max_model_len": max_model_len})()
        self.speculative_config = type("S", (), {"num_speculative_tokens": k})()


def test_the_proposer_drafts_one_chain_per_row_of_vllms_batch(builtin_artifacts, smol_tokenizer):
    import numpy as np

    proposer = SchemaFillProposer(_Config(str(builtin_artifacts / "targets" / "smollm2-135m-base"), 4, 4096))
    proposer.load_model()
    rows = [after(smol_tokenizer, "bm25", ""), after(smol_tokenizer, "one_tool", "")]
    ids = np.zeros((3, 4096), dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    lengths = np.array([len(rows[0]), len(rows[1]), 0])
    drafts = proposer.propose([[1], [2], []], lengths, ids)
    assert drafts[0] == ChainDrafter(smol_tokenizer).draft(rows[0], 4) and len(drafts[0]) == 4
    assert drafts[1] == ChainDrafter(smol_tokenizer).draft(rows[1], 4)
    assert drafts[2] == []  # sampled nothing this step (a prompt still in pieces)
    with pytest.raises(ValueError, match="SCHEMAFILL_RESPONSE_FORMAT"):
        response_format({"SCHEMAFILL_RESPONSE_FORMAT": "xml"})
    assert response_format({}) is None and response_format({"SCHEMAFILL_RESPONSE_FORMAT": "json"}) is JSON


def test_batch_pricing_keeps_long_chains_alone_and_only_sure_tokens_in_a_big_batch():
    from infer.vllm.chains import STRUCTURE
    from infer.vllm.proposer import MIN_POINTS, BatchPricing

    COPY = "copy_prompt4"  # a copy after 3-7 agreeing tokens: 1 in 2 before any is observed
    pricing = BatchPricing()
    chains = [([1, 2, 3, 4, 5, 6], STRUCTURE), ([7, 8, 9, 10], COPY)]
    assert pricing.keep(chains) == [6, 4]  # nothing measured yet: every chain whole
    for rows in range(MIN_POINTS):  # a step costs 40 ms + 0.2 ms a row: one request's rows are nearly free
        pricing.observe_step(1 + rows, 40.0 + 0.2 * (1 + rows))
    assert pricing.cost() == pytest.approx((40.0, 0.2))
    assert pricing.keep([([7, 8, 9, 10], COPY)]) == [4]  # even a copy's fourth token (1 in 16) pays
    steep = BatchPricing()
    for rows in range(MIN_POINTS):  # 40 ms + 5 ms a row, as a CPU's batch of sixteen pays
        steep.observe_step(16 + rows, 40.0 + 5 * (16 + rows))
    sixteen = [([1, 2, 3, 4, 5, 6], STRUCTURE)] + [([7, 8, 9, 10], COPY)] * 14 + [([], "")]
    counts = steep.keep(sixteen)
    assert counts[-1] == 0  # a request with nothing drafted
    assert counts[0] > max(counts[1:])  # the structure (0.9 a token) keeps more than copies (0.5)
    assert sum(counts) < 6 + 15 * 4
    # copies that are always taken earn their rows
    for _ in range(50):
        steep.observe_chain(COPY, 4, 4)
    assert steep.keep(sixteen)[1:] == [4] * 14 + [0]


def test_steps_all_alike_keep_the_last_cost_fit():
    from infer.vllm.proposer import COST_POINTS, MIN_POINTS, BatchPricing

    pricing = BatchPricing()
    for rows in range(MIN_POINTS):
        pricing.observe_step(1 + rows, 20.0 + 2 * (1 + rows))
    assert pricing.cost() == pytest.approx((20.0, 2.0))
    for _ in range(COST_POINTS):  # one request drafting nothing: every step one row
        pricing.observe_step(1, 22.0)
    assert pricing.cost() == pytest.approx((20.0, 2.0))  # not "unmeasured", which would send chains whole


def test_the_proposer_learns_from_what_vllm_committed_after_its_draft(builtin_artifacts, smol_tokenizer):
    import numpy as np

    from infer.vllm.chains import STRUCTURE

    proposer = SchemaFillProposer(_Config(str(builtin_artifacts / "targets" / "smollm2-135m-base"), 4, 4096))
    row = after(smol_tokenizer, "bm25", "")
    ids = np.zeros((1, 4096), dtype=np.int32)
    ids[0, :len(row)] = row
    draft = proposer.propose([[1]], np.array([len(row)]), ids)[0]
    assert len(draft) == 4
    # vLLM took the first two drafted tokens, then its own token
    taken = draft[:2] + [draft[2] + 1]
    ids[0, len(row):len(row) + 3] = taken
    before = proposer.pricing.stats.rate(STRUCTURE)
    proposer.propose([[taken[-1]]], np.array([len(row) + 3]), ids)
    assert proposer.pricing.stats.reached[STRUCTURE] == 3 and proposer.pricing.stats.accepted[STRUCTURE] == 2
    assert proposer.pricing.stats.rate(STRUCTURE) < before
