"""Parallel Fill fills AR's skeleton value by value; where a value's private context is
exactly AR's own prefix (the first field of the first call) it must reproduce AR's value."""

from __future__ import annotations

import pytest
import torch

from infer.decoders.parallel_fill import ParallelFill, ValueStop
from schemafill.contract.parser import response_layout
from schemafill.contract.prompt import prompt_ids
from schemafill.contract.response_format import JSON, dumps
from schemafill.runtime.loading import generation_eos, load_tokenizer
from tests.conftest import decode_ar

HEADER = JSON.header
from schemafill.runtime.loading import load_target
from tests.decoders.test_schemafill import request


@pytest.mark.parametrize("text, literal, reason", [
    (' 12, "b"', "12", "closed"),  # a number closes at the character after it
    (' "a \\"quoted\\" word"}', '"a \\"quoted\\" word"', "closed"),
    (' {"x": [1, 2]}, "y"', '{"x": [1, 2]}', "closed"),
    (' 12', None, None),  # still open
    (' ]', None, "error"),
])
def test_value_stop(smol_tokenizer, text, literal, reason):
    header = HEADER + JSON.call_header("f") + dumps("a") + ":"
    stop = ValueStop(smol_tokenizer, frozenset({smol_tokenizer.eos_token_id}), header, "a", max_tokens=40)
    ids = smol_tokenizer(text, add_special_tokens=False).input_ids
    taken = stop.push(ids)
    assert (stop.literal, stop.reason) == (literal, reason)
    assert taken <= len(ids) and (reason is None) == (taken == len(ids) and not stop.done)


def test_value_stop_eos_and_cap(smol_tokenizer):
    header = HEADER + JSON.call_header("f") + dumps("a") + ":"
    eos = smol_tokenizer.eos_token_id
    stop = ValueStop(smol_tokenizer, frozenset({eos}), header, "a", max_tokens=40)
    assert stop.push(smol_tokenizer(' "ab', add_special_tokens=False).input_ids + [eos, 5]) > 0
    assert stop.reason == "eos" and stop.ids[-1] == eos
    stop = ValueStop(smol_tokenizer, frozenset({eos}), header, "a", max_tokens=2)
    stop.push(smol_tokenizer(' "a long string value', add_special_tokens=False).input_ids)
    assert stop.reason == "length" and len(stop.ids) == 2


def test_fills_ars_skeleton_on_the_builtin_model(builtin_artifacts):
    folder = builtin_artifacts / "targets" / "smollm2-135m-base"
    tok = load_tokenizer(str(folder))
    eos = generation_eos(str(folder), tok)
    target = load_target(folder, torch.float32, torch.device("cpu"), [2, 15, 27], backend="eager")
    pf = ParallelFill(target, tok, eos, max_value_tokens=24)
    filled = 0
    for name in ("repeated", "wrong_tools"):  # where the base model writes closed values
        ids = prompt_ids(request(name), "plain", tok)
        ar = decode_ar(target, tok, ids, 64, eos)
        skeleton = response_layout(ar.text)
        out = pf.fill(ids, ar.text, ar.ids)
        rebuilt = response_layout(out.text)
        assert [(c.name, [k for k, _, _ in c.spans]) for c in rebuilt][: len(skeleton)] == \
            [(c.name, [k for k, _, _ in c.spans]) for c in skeleton]  # the layout is AR's
        assert (out.ids == ar.ids) == (out.text == ar.text)
        first = skeleton[0] if skeleton else None
        if first and first.spans and ar.text.startswith(HEADER + JSON.call_header(first.name) + dumps(first.spans[0][0]) + ":"):
            key, a, e = first.spans[0]
            b, f = rebuilt[0].spans[0][1:]
            assert out.text[b:f] == ar.text[a:e]  # the same context as AR's: the same greedy value
            filled += 1
    assert filled == 2  # the check above ran for both


def test_fills_an_args_first_skeleton_in_hermes3(builtin_artifacts):
    """hermes3: each value's context is ``<tool_call>\\n{"arguments": {"<key>":``, no name; the
    first one is AR's own context, so its value is AR's."""
    from schemafill.contract.response_format import HERMES3
    from tests.decoders.test_schemafill import args_first_request

    folder = builtin_artifacts / "targets" / "smollm2-135m-base"
    tok = load_tokenizer(str(folder))
    eos = generation_eos(str(folder), tok)
    target = load_target(folder, torch.float32, torch.device("cpu"), [2, 15, 27], backend="eager")
    ids = prompt_ids(args_first_request(), "plain", tok, fmt=HERMES3)
    ar = decode_ar(target, tok, ids, 32, eos, fmt=HERMES3)
    skeleton = response_layout(ar.text, HERMES3)
    assert [(c.name, [k for k, _, _ in c.spans]) for c in skeleton] == [("get_weather", ["city", "unit"])]
    out = ParallelFill(target, tok, eos, max_value_tokens=8, fmt=HERMES3).fill(ids, ar.text, ar.ids)
    rebuilt = response_layout(out.text, HERMES3)
    assert [(c.name, [k for k, _, _ in c.spans]) for c in rebuilt] == [("get_weather", ["city", "unit"])]
    (_, a, e), (_, b, f) = skeleton[0].spans[0], rebuilt[0].spans[0]
    assert out.text[b:f] == ar.text[a:e] == '"Oslo"'
