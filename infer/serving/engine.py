"""The server's decoding side: the target, tokenizer and decoders loaded once, a bounded
queue in front of them, one decode at a time, and the Prometheus metrics of what it did.

Batch 1: every decoder keeps per-launch state (its head's KV arena, node budget, what the
learning peers remember), so requests take turns on one worker thread. A request that
cannot wait (``queue_size`` already waiting) is refused with 503 at once; a request whose
client went away is dropped before its turn or stopped at its next round
(``DecodeOptions.on_commit`` raises ``Cancelled``), so it frees its place either way.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from infer import decoders
from infer.decoders.context import DecoderContext
from infer.serving.protocol import APIError, ChatRequest
from infer.spec.constraint import SchemaGrammars
from infer.spec.decoding import Decoded, DecodeOptions
from infer.spec.options import request_options
from schemafill.config import ServeConfig
from schemafill.device import resolve_device
from schemafill.models import load_launch_target
from schemafill.prompt import model_prompt_ids
from schemafill.toolcall import ToolRequest


class Cancelled(Exception):
    """The client went away: the decode stops at its next round."""


@dataclass
class Job:
    chat: ChatRequest
    prompt: list[int]
    options: DecodeOptions
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None


class ServeMetrics:
    """Counters and histograms by method, in a registry of this server's own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("schemafill_requests", "Chat-completion requests answered, by outcome",
                                ["method", "status"], registry=r)
        self.prompt_tokens = Counter("schemafill_prompt_tokens", "Prompt tokens decoded", ["method"], registry=r)
        self.completion_tokens = Counter("schemafill_completion_tokens", "Response tokens committed", ["method"],
                                         registry=r)
        self.target_calls = Counter("schemafill_target_calls", "Target forward calls (prefill included)", ["method"],
                                    registry=r)
        self.accept_length = Histogram("schemafill_accept_length", "Response tokens per target call, per request",
                                       ["method"], buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12), registry=r)
        self.latency = Histogram("schemafill_request_seconds", "Request latency, queueing included", ["method"],
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=r)
        self.queue_seconds = Histogram("schemafill_queue_seconds", "Time a request waited for the decoder",
                                       ["method"], buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 4, 8, 16, 32), registry=r)
        self.queue_depth = Gauge("schemafill_queue_depth", "Requests decoding or waiting", registry=r)

    def decoded(self, job: Job, d: Decoded, seconds: float) -> None:
        m = job.chat.method
        self.prompt_tokens.labels(m).inc(len(job.prompt))
        self.completion_tokens.labels(m).inc(len(d.ids))
        self.target_calls.labels(m).inc(d.target_calls)
        if d.target_calls:
            self.accept_length.labels(m).observe(len(d.ids) / d.target_calls)
        self.latency.labels(m).observe(seconds)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


WARMUP = ToolRequest(
    id="warmup", messages=[{"role": "user", "content": "What is the weather in Paris today?"}],
    tools=[{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}])


class Engine:
    """The models a server answers for, and the one worker that decodes for them."""

    def __init__(self, cfg: ServeConfig) -> None:
        methods = list(dict.fromkeys([cfg.method, *cfg.methods]))
        refused = [m for m in methods if m in decoders.SKELETON_METHODS]
        if refused:
            raise ValueError(f"{refused} fill AR's answer and are not lossless: they cannot be served")
        decoders.check(methods, 0.0)
        self.cfg = cfg
        device = resolve_device(cfg.device)
        self.target, self.tokenizer, self.eos = load_launch_target(cfg.model, cfg.paths.artifacts, device)
        self.fmt = cfg.model.fmt
        ctx = DecoderContext(self.target, self.tokenizer, self.eos, cfg.decode,
                             cfg.head or str(Path(cfg.paths.artifacts) / "heads" / cfg.model.name), fmt=self.fmt)
        self.decoders = decoders.build(methods, ctx)
        name = cfg.model.name
        self.models = {name: cfg.method, **{f"{name}:{m}": m for m in methods}}  # model id -> method
        self._grammars: SchemaGrammars | None = None
        self.metrics = ServeMetrics()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="schemafill-decode")
        self._lock = threading.Lock()
        self._live: dict[int, Job] = {}  # submitted and not done, by id
        self.created = int(time.time())
        if cfg.warmup:
            for decoder in self.decoders.values():
                decoder.decode(WARMUP, self.prompt(WARMUP), DecodeOptions())
                decoders.reset(decoder)  # the learning peers start from what clients send, not the warm-up

    # ---- a request, ready to decode
    def prompt(self, request: ToolRequest) -> list[int]:
        return model_prompt_ids(request, self.cfg.model, self.tokenizer)

    @property
    def grammars(self) -> SchemaGrammars:
        if self._grammars is None:  # xgrammar and the vocabulary's tables: only once a request needs them
            self._grammars = SchemaGrammars(self.tokenizer, self.target.config.vocab_size, fmt=self.fmt,
                                            stop_ids=self.eos)
        return self._grammars

    def prepare(self, chat: ChatRequest) -> Job:
        """Render the prompt, check it fits, and choose how each node is decided."""
        d = self.cfg.decode
        try:
            prompt = self.prompt(chat.request)
        except Exception as e:  # a chat template that refuses this conversation (e.g. roles out of order)
            raise APIError(400, f"the conversation cannot be rendered as a prompt: {e}", "messages") from None
        cap = chat.max_tokens or d.max_new_tokens
        if len(prompt) + cap > self.cfg.model.max_context:
            raise APIError(400, f"the prompt has {len(prompt)} tokens and max_tokens is {cap}: together they exceed "
                                f"the model's context of {self.cfg.model.max_context} tokens", "messages",
                           "context_length_exceeded")
        seed = chat.seed if chat.seed is not None else random.getrandbits(32)
        try:  # a required call decodes under the allowed tools' grammar: lossless against constrained AR
            options = request_options(d, lambda: self.grammars, chat.request.functions if chat.tool_choice == "auto"
                                      else [], seed=seed, temperature=chat.temperature, top_p=chat.top_p,
                                      max_tokens=cap, required=chat.grammar_functions if chat.constrained else None)
        except Exception as e:  # a schema the grammar engine cannot compile
            raise APIError(400, f"the tools' parameter schemas do not make a response grammar: "
                                f"{type(e).__name__}: {e}", "tools") from None
        return Job(chat, prompt, options)

    # ---- the queue and the worker
    @property
    def outstanding(self) -> int:
        """Requests decoding or waiting whose client is still there (a job whose client went
        away gives its place back at once, though the worker drops it only on its turn)."""
        with self._lock:
            return sum(not j.cancel.is_set() for j in self._live.values())

    def submit(self, job: Job, on_commit: Callable[[list[int]], None] | None = None) -> Future:
        """Queue ``job``; refuse it (503) when ``queue_size`` requests already wait."""
        if self.outstanding >= 1 + self.cfg.queue_size:
            self.metrics.requests.labels(job.chat.method, "503").inc()
            raise APIError(503, f"the server is busy: one request is decoding and {self.cfg.queue_size} are "
                                "waiting (queue_size); retry shortly", code="server_busy", kind="server_error")
        with self._lock:
            self._live[id(job)] = job
        try:
            future = self.executor.submit(self._decode, job, on_commit)
        except RuntimeError:  # shut down
            self._release(job)
            raise APIError(503, "the server is shutting down", code="server_busy", kind="server_error") from None
        future.add_done_callback(lambda _: self._release(job))  # also when the future is cancelled unrun
        self.metrics.queue_depth.set(self.outstanding)
        return future

    def _release(self, job: Job) -> None:
        with self._lock:
            self._live.pop(id(job), None)
        self.metrics.queue_depth.set(self.outstanding)

    def _decode(self, job: Job, on_commit: Callable[[list[int]], None] | None) -> Decoded:
        if job.cancel.is_set():
            raise Cancelled()
        job.started_at = time.perf_counter()
        self.metrics.queue_seconds.labels(job.chat.method).observe(job.started_at - job.queued_at)

        def commit(ids: list[int]) -> None:
            if job.cancel.is_set():
                raise Cancelled()
            if on_commit is not None:
                on_commit(ids)

        decoded = self.decoders[job.chat.method].decode(job.chat.request, job.prompt,
                                                        replace(job.options, on_commit=commit))
        self.metrics.decoded(job, decoded, time.perf_counter() - job.queued_at)
        return decoded

    def text(self, ids: list[int], final: bool = False) -> str:
        """The response text an answer is made of, the same for every prefix a stream sees and
        for the finished response: no clean-up of spaces (which revises earlier text when a
        later token arrives), and, until ``final``, no multi-byte character still split."""
        text = self.fmt.decode(self.tokenizer, ids, clean_up_tokenization_spaces=False)
        return text if final else text.rstrip("\ufffd")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
