"""ToolSpec's retrieval store on literal cases; ToolSpec-lite on the built-in model: lossless,
within its 16 nodes, and its FSM and retrieval cut target calls (the other peers' tests:
test_peers.py)."""

from __future__ import annotations

import pytest
import torch

from infer.decoders.ar import decode_ar
from infer.decoders.toolspec_lite import ToolSpecLite
from infer.retrieval import RetrievalStore
from schemafill.models import generation_eos, load_tokenizer
from schemafill.prompt import prompt_ids
from schemafill.runtime import load_target
from tests.test_schemafill import CASES, request


def test_store_returns_the_most_similar_outputs_but_never_the_requests_own():
    store = RetrievalStore(k=2)
    store.add("a", torch.tensor([1.0, 0.0]), [1])
    store.add("b", torch.tensor([0.6, 0.8]), [2])
    store.add("c", torch.tensor([0.0, 1.0]), [3])
    store.add("a", torch.tensor([0.0, 1.0]), [99])  # decoded again: the first output stays
    assert store.nearest(torch.tensor([1.0, 0.1]), exclude="x") == [[1], [2]]
    assert store.nearest(torch.tensor([1.0, 0.1]), exclude="a") == [[2], [3]]


@pytest.mark.slow  # 70-115 s on 2 AVX2 cores: `make test-full`
def test_lossless_and_fewer_calls_on_the_builtin_model(builtin_artifacts):
    folder = builtin_artifacts / "targets" / "smollm2-135m-base"
    tok = load_tokenizer(str(folder))
    eos = generation_eos(str(folder), tok)
    target = load_target(folder, torch.float32, torch.device("cpu"), [2, 15, 27])
    ts = ToolSpecLite(target, tok, eos, 48)
    saved = 0
    for name in CASES:
        ids = prompt_ids(request(name), "plain", tok)
        ar = decode_ar(target, tok, ids, 48, eos)
        out = ts.decode(request(name), ids)
        assert out.ids == ar.ids, name
        assert max(out.nodes[1:], default=0) <= 16
        saved += ar.target_calls - out.target_calls
    assert len(ts.store.ids) == len(CASES)
    assert saved > len(CASES) * 5  # the header, tool names and keys come from the schema FSM
