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

How much of each chain goes to vLLM is priced per step, as our own runtime prices a batch
(``BatchPricing``): a chain's tokens are worth their chance of being accepted (learnt per kind of
chain from what vLLM committed after each draft), a row costs what vLLM's step measured (a + b·rows,
fitted to the time between calls), and the rows kept across the batch are those that raise the
step's expected tokens per millisecond: where rows are nearly free (one request on a CPU) long chains
go, where a row costs about what a token is worth (many requests) only the surest tokens do.

Drafting itself is host time in vLLM's step loop, serial with the forward: a request's drafting
is skipped where the tokens it adds do not pay for its milliseconds at the batch's measured rate
of committed tokens, as our own round loop backs off (``infer/rounds/backoff.py``) — alone it
nearly always pays; in a big batch whose rows are cheap (a GPU) the same milliseconds cost many
requests' tokens. Each request's tokens are read incrementally (``chains.Reading``), so a step's
host time grows with its new tokens, not with every response's length.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict, deque
from typing import Any

from infer.pricing.acceptance import AcceptanceStats
from infer.pricing.cost_model import line_fit
from infer.pricing.selection import path_values, select
from infer.rounds.backoff import LAUNCH_HORIZON, DraftWorth, RoundRate
from infer.rounds.tree import ROOT
from infer.vllm.chains import STRUCTURE, VALUE, ChainDrafter, Reading
from schemafill.contract.response_format import FORMATS

FORMAT_ENV = "SCHEMAFILL_RESPONSE_FORMAT"


def response_format(env: dict[str, str]):
    name = env.get(FORMAT_ENV)
    if name is None:
        return None
    if name not in FORMATS:
        raise ValueError(f"{FORMAT_ENV}={name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name]


# acceptance before any is observed; a copy starts from the runtime's prior for its source
# (``infer/pricing/acceptance.py``: by how long its agreement with the text before it is)
PRIORS = {STRUCTURE: 0.9, VALUE: 0.6}
COST_POINTS = 64  # steps the cost fit remembers
MIN_POINTS = 8  # steps before rows are priced (until then every chain goes whole)
REQUESTS_KEPT = 1024  # requests whose last draft and drafting worth are remembered


class BatchPricing:
    """Which draft tokens a vLLM step verifies (module docstring). Pure but for the clock the
    caller reads: ``observe_step(rows, ms)``, ``observe_chain(kind, drafted, accepted)``,
    ``keep(chains, requests)``."""

    def __init__(self) -> None:
        self.stats = AcceptanceStats(priors=dict(PRIORS))
        self.points: deque[tuple[int, float]] = deque(maxlen=COST_POINTS)
        self.fitted: tuple[float, float] | None = None  # the last fit (kept while steps are all alike)

    def observe_step(self, rows: int, ms: float) -> None:
        self.points.append((rows, ms))

    def observe_chain(self, kind: str, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` tokens of ``kind`` had its first ``accepted`` taken."""
        self.stats.observe([ROOT] + list(range(drafted - 1)), [kind] * drafted, list(range(accepted)))

    def cost(self) -> tuple[float, float] | None:
        """``(a, b)``: a step of n rows costs a + b·n ms (least squares), once measured. Steps
        that all had the same rows (one request drafting nothing for a while) say nothing of a
        row's cost: the last fit stands."""
        if len(self.points) < MIN_POINTS:
            return self.fitted
        rows, ms = zip(*self.points)
        fit = line_fit(rows, ms)
        if fit is not None:
            b = max(0.0, fit[1])  # a row never makes a step cheaper
            self.fitted = (max(sum(ms) / len(ms) - b * sum(rows) / len(rows), 0.0), b)
        return self.fitted

    def keep(self, chains: list[tuple[list[int], str]]) -> list[int]:
        """How many tokens of each chain to verify: the nodes of all chains (a forest) that
        maximise the step's expected tokens per ms, each request's own token counted too."""
        fitted = self.cost()
        if fitted is None:
            return [len(c) for c, _ in chains]
        a, b = fitted
        parents, values, owner = [], [], []
        for j, (chain, kind) in enumerate(chains):
            if not chain:
                continue
            first = len(parents)
            parents += [ROOT] + [first + i for i in range(len(chain) - 1)]
            values += path_values([ROOT] + list(range(len(chain) - 1)), [self.stats.rate(kind)] * len(chain))
            owner += [j] * len(chain)
        requests = len(chains)
        kept = select(parents, values, lambda n: a + b * n, fixed_rows=requests, base=requests)
        counts = [0] * len(chains)
        for i in kept:
            counts[owner[i]] += 1
        return counts


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
        self.pricing = BatchPricing()
        self.rate = RoundRate()  # the batch's committed tokens per ms of vLLM's whole step
        self.launch = DraftWorth(horizon=LAUNCH_HORIZON)  # what drafting brought lately (each request's prior)
        # by request (its prompt): its drafting worth, and its last drafting — where, the chain
        # vLLM got, its kind and its milliseconds
        self.worths: OrderedDict[tuple[int, ...], DraftWorth] = OrderedDict()
        self.sent: OrderedDict[tuple[int, ...], tuple[int, list[int], str, float]] = OrderedDict()
        self.held: list[Reading] = []  # the last step's readings, by row of vLLM's batch
        self.last: tuple[float, float, int, int] | None = None  # the previous call: start, end, rows, requests

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's worker calls it at start-up; there is no model to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """One chain per request of vLLM's batch (row i of ``token_ids_cpu`` holds request i's
        prompt and output, its first ``num_tokens_no_spec[i]`` tokens verified); none for a
        request that sampled nothing this step (a prompt still in pieces), has no room left,
        or whose drafting does not pay in this batch."""
        now = time.perf_counter()
        if self.last is not None:
            started, ended, rows, requests = self.last
            if all(len(s) for s in sampled_token_ids) and requests == len(sampled_token_ids):
                # the step since the last call verified what it sent, and took no new prompt
                self.pricing.observe_step(rows, 1e3 * (now - ended))
            self.rate.round(sum(map(len, sampled_token_ids)), 1e3 * (now - started))
        chains: list[tuple[list[int], str]] = []
        readings: list[Reading] = []
        spent: list[float] = []  # each request's drafting ms this step (-1: not drafted)
        taken: set[int] = set()  # the last step's readings advanced already (each goes on once)
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            tokens = token_ids_cpu[i, :n].tolist()
            reading = self.drafter.read(tokens, self._held(i, tokens, taken))
            readings.append(reading)
            worth = None if reading.key is None else self._worth(reading.key)
            if worth is not None:
                self._learn(reading.key, tokens, worth)
            room = min(self.k, self.max_model_len - n - 1)
            chain, ms = ([], ""), -1.0
            if len(sampled) and room >= 1 and reading.parser is not None and worth.worth(self.rate.rate):
                t0 = time.perf_counter()
                chain = self.drafter.draft_tagged(tokens, room, reading)
                ms = 1e3 * (time.perf_counter() - t0)
            chains.append(chain)
            spent.append(ms)
        self.held = readings
        counts = self.pricing.keep(chains)
        drafts = [chain[:c] for (chain, _), c in zip(chains, counts)]
        for i, (reading, (_, kind), d, ms) in enumerate(zip(readings, chains, drafts, spent)):
            if reading.key is not None and ms >= 0:
                self.sent[reading.key] = (int(num_tokens_no_spec[i]), d, kind, ms)
                self.sent.move_to_end(reading.key)
        for kept in (self.sent, self.worths):
            while len(kept) > REQUESTS_KEPT:
                kept.popitem(last=False)
        self.last = (now, time.perf_counter(), sum(1 + len(d) for d in drafts), len(sampled_token_ids))
        return drafts

    def _held(self, row: int, tokens: list[int], taken: set[int]) -> Reading | None:
        """The last step's reading of the request now at ``row``: one whose tokens these extend
        (at the same row, or moved in vLLM's batch) and that no other row took this step (two
        requests alike must not advance one parser); None for a request new to it."""
        for j in itertools.chain((row,) if row < len(self.held) else (), range(len(self.held))):
            r = self.held[j]
            if j not in taken and r.extended_by(tokens):
                taken.add(j)
                return r
        return None

    def _worth(self, key: tuple[int, ...]) -> DraftWorth:
        worth = self.worths.get(key)
        if worth is None:
            worth = self.worths[key] = DraftWorth(self.launch)
        self.worths.move_to_end(key)
        return worth

    def _learn(self, key: tuple[int, ...], tokens: list[int], worth: DraftWorth) -> None:
        """What vLLM committed after this request's (``key``: its prompt) last drafting says of
        its chain's kind, and of what the drafting was worth."""
        sent = self.sent.get(key)
        if sent is None:
            return
        at, draft, kind, ms = sent
        new = tokens[at:]
        if not new:  # not verified since (a step that did not schedule it)
            return
        del self.sent[key]
        accepted = 0
        while accepted < min(len(draft), len(new) - 1) and draft[accepted] == new[accepted]:
            accepted += 1
        if draft:
            self.pricing.observe_chain(kind, len(draft), accepted)
        worth.drafted(accepted + 1, ms)
