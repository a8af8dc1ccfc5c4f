"""SchemaFill's drafting as a vLLM speculative proposer (``custom_class``):

    LLM(model=..., speculative_config={"method": "custom_class",
                                       "model": "infer.vllm.proposer.SchemaFillProposer",
                                       "num_speculative_tokens": 8})

vLLM builds the class with its ``VllmConfig`` and, every step, asks ``propose`` for one draft
chain per running request from token ids alone; its rejection sampler then decides every
token, so nothing here can change vLLM's output. The drafting is ``drafting.ChainDrafter``:
state is derived from each request's tokens at every step (cached per prompt), never kept by
batch position, so requests joining, finishing or being reordered in vLLM's batch cannot
inherit another's. ``SCHEMAFILL_RESPONSE_FORMAT`` (json, hermes, hermes3, mistral) fixes the
format the drafts are written in; by default each prompt's own instructions decide.
"""

from __future__ import annotations

import os
from typing import Any

from infer.vllm.drafting import ChainDrafter
from schemafill.response_format import FORMATS

FORMAT_ENV = "SCHEMAFILL_RESPONSE_FORMAT"


def response_format(env: dict[str, str]):
    name = env.get(FORMAT_ENV)
    if name is None:
        return None
    if name not in FORMATS:
        raise ValueError(f"{FORMAT_ENV}={name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name]


class SchemaFillProposer:
    """What vLLM's ``custom_class`` method loads (module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        from transformers import AutoTokenizer

        model = vllm_config.model_config
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model.max_model_len)
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, revision=getattr(model, "tokenizer_revision", None),
                                                  trust_remote_code=bool(getattr(model, "trust_remote_code", False)))
        self.drafter = ChainDrafter(tokenizer, fmt=response_format(dict(os.environ)))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's worker calls it at start-up; there is no model to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """One chain per request of vLLM's batch (row i of ``token_ids_cpu`` holds request i's
        prompt and output, its first ``num_tokens_no_spec[i]`` tokens verified); none for a
        request that sampled nothing this step (a prompt still in pieces) or has no room left."""
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - n - 1)
            if not len(sampled) or room < 1:
                drafts.append([])
                continue
            drafts.append(self.drafter.draft(token_ids_cpu[i, :n].tolist(), room))
        return drafts
