"""The server's decoding side: the target, tokenizer and decoders loaded once, a bounded
queue in front of them, one batch decoding in one loop (``Engine.run``, on the main thread
where it can be), and the Prometheus metrics of what it did.

Continuous batching (``infer/rounds/loop.Batch``): up to ``max_batch`` requests decode
together, whatever their methods, one target forward per round for all of them; a waiting
request joins between rounds as soon as one leaves, its prompt in pieces of
``prefill_tokens`` while the others decode, and from the KV of an earlier prompt that starts
the same where one is kept (``prefix_cache_mb``: system prompts, tool catalogs, an agent's
earlier turns). ``queue_size`` more may wait; a request beyond
them is refused with 503 and a ``Retry-After`` at once. A request whose client went away is
dropped before it joins, or leaves the batch at the next round (its rows and KV arena
freed), so it gives its place back either way.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from infer import decoders
from infer.decoders.context import DecoderContext
from infer.rounds.decoding import Decoded, DecodeOptions
from infer.rounds.loop import Batch, Stream
from infer.rounds.options import request_options
from infer.rounds.prefixes import PrefixCache
from infer.rounds.sampling import SamplingParams
from infer.serving.protocol import APIError, ChatRequest
from schemafill.config import ServeConfig
from schemafill.contract.prompt import model_prompt_ids
from schemafill.contract.stopping import visible
from schemafill.contract.toolcall import ToolRequest
from schemafill.runtime.device import resolve_device
from schemafill.runtime.grammar import SchemaGrammars
from schemafill.runtime.loading import load_launch_target


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
    future: Future = field(default_factory=Future)
    on_commit: Callable[[list[int], list | None], None] | None = None


class ServeMetrics:
    """Counters and histograms by method, in a registry of this server's own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("schemafill_requests", "Chat-completion requests answered, by outcome",
                                ["method", "status"], registry=r)
        self.prompt_tokens = Counter("schemafill_prompt_tokens", "Prompt tokens decoded", ["method"], registry=r)
        self.reused_tokens = Counter("schemafill_prompt_tokens_reused",
                                     "Prompt tokens whose KV was copied from an earlier prompt's, not prefilled",
                                     ["method"], registry=r)
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
        self.batch_size = Histogram("schemafill_batch_size", "Requests in each round's target forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.round_rows = Histogram("schemafill_round_rows", "Rows of each round's target forward (every request's)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)

    def decoded(self, job: Job, d: Decoded, seconds: float, reused: int = 0) -> None:
        m = job.chat.method
        self.prompt_tokens.labels(m).inc(len(job.prompt))
        self.reused_tokens.labels(m).inc(reused)
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
        self.batch = Batch(self.target, cfg.prefill_tokens,
                           PrefixCache(cfg.prefix_cache_mb << 20) if cfg.prefix_cache_mb else None)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._live: dict[int, Job] = {}  # submitted and not done, by id
        self._jobs: dict[int, Job] = {}  # decoding, by their stream's id
        self._tasks: deque[tuple[Callable[[], object], Future]] = deque()  # run by the loop between rounds
        self._closed = False
        self.created = int(time.time())
        if cfg.warmup:
            for decoder in self.decoders.values():
                decoder.decode(WARMUP, self.prompt(WARMUP), DecodeOptions())
                decoders.reset(decoder)  # the learning peers start from what clients send, not the warm-up
        self.worker: threading.Thread | None = None

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
        vocab = self.target.config.vocab_size
        outside = [t for t, _ in chat.penalties.get("logit_bias", ()) if t >= vocab]
        if outside:
            raise APIError(400, f"logit_bias names token ids {outside[:5]} outside the vocabulary of {vocab}",
                           "logit_bias")
        try:
            SamplingParams(**chat.sampling)
        except ValueError as e:  # fields each in range that contradict each other
            raise APIError(400, str(e), "temperature") from None
        # a required call decodes under the allowed tools' grammar, a structured output under its
        # schema's: lossless against constrained AR
        param = "response_format" if chat.structured else "tools"
        try:
            options = request_options(d, lambda: self.grammars, chat.request.functions if chat.tool_choice == "auto"
                                      else [], seed=seed, sampling=chat.sampling, max_tokens=cap,
                                      required=chat.grammar_functions if chat.constrained else None,
                                      request=chat.request, stops=chat.stops, logprobs=chat.logprobs)
        except Exception as e:  # a schema the grammar engine cannot compile
            raise APIError(400, f"the {param} schemas do not make a response grammar: {type(e).__name__}: {e}",
                           param) from None
        return Job(chat, prompt, options)

    # ---- the queue and the worker
    @property
    def outstanding(self) -> int:
        """Requests decoding or waiting whose client is still there (a job whose client went
        away gives its place back at once, though the worker drops it only at its next round)."""
        with self._cond:
            return self._outstanding()

    def _outstanding(self) -> int:  # with ``_cond`` held
        return sum(not j.cancel.is_set() for j in self._live.values())

    @property
    def decoding(self) -> int:
        """Requests in the batch."""
        with self._cond:
            return len(self._jobs)

    def submit(self, job: Job, on_commit: Callable[[list[int], list | None], None] | None = None) -> Future:
        """Queue ``job`` for the batch; refuse it (503) when ``max_batch`` decode and
        ``queue_size`` wait already."""
        cfg = self.cfg
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="server_busy", kind="server_error")
            if self._outstanding() >= cfg.max_batch + cfg.queue_size:
                self.metrics.requests.labels(job.chat.method, "503").inc()
                raise APIError(503, f"the server is busy: {cfg.max_batch} requests are decoding and "
                                    f"{cfg.queue_size} are waiting (max_batch, queue_size); retry shortly",
                               code="server_busy", kind="server_error", retry_after=1)
            job.on_commit = on_commit
            self._live[id(job)] = job
            self._waiting.append(job)
            self._cond.notify()
        self.metrics.queue_depth.set(self.outstanding)
        return job.future

    def start(self) -> None:
        """Run the decode loop on a thread of its own (once), for a caller whose main thread is
        busy (tests). ``run`` on the main thread is faster on a CPU: a second thread's OpenMP
        team makes GNU OpenMP throttle its spin-waits, and every few-row product then pays
        for waking its threads (docs/design.md, Serving)."""
        if self.worker is None:
            self.worker = threading.Thread(target=self.run, name="schemafill-decode", daemon=True)
            self.worker.start()

    def run(self) -> None:
        """The decode loop, until ``close``: admit waiting jobs into the batch, run a round,
        answer the ones that ended."""
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self.batch.streams and not self._tasks:
                    self._cond.wait()
                if self._closed:
                    break
                tasks = list(self._tasks)
                self._tasks.clear()
                admit = []
                while self._waiting and len(self.batch.streams) + len(admit) < self.cfg.max_batch:
                    admit.append(self._waiting.popleft())
            for fn, done in tasks:
                try:
                    done.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller's to handle
                    done.set_exception(e)
            for job in admit:
                self._join(job)
            for stream in self.batch.streams:
                if self._jobs[id(stream)].cancel.is_set() and stream.error is None:
                    stream.error = Cancelled()  # leaves at this round: its rows and arena go with it
            if not self.batch.streams:
                continue
            self.metrics.batch_size.observe(len(self.batch.streams))
            try:
                ended = self.batch.step()
            except Exception as e:  # noqa: BLE001 - the forward itself failed: every request in it does
                ended = list(self.batch.streams)
                self.batch.streams.clear()
                for stream in ended:
                    stream.error = e
            if self.batch.last_rows:
                self.metrics.round_rows.observe(self.batch.last_rows)
            for stream in ended:
                self._end(self._jobs.pop(id(stream)), stream)
        for job in [*self._waiting, *(self._jobs.values())]:  # shut down: nobody is left waiting forever
            self._finish(job, error=APIError(503, "the server is shutting down", code="server_busy",
                                             kind="server_error"))

    def between_rounds(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the decode loop's thread between two rounds (e.g. a bench resetting what
        a method learnt: torch work on another thread would slow the loop, ``start``)."""
        done: Future = Future()
        with self._cond:
            self._tasks.append((fn, done))
            self._cond.notify()
        return done

    def _join(self, job: Job) -> None:
        """``job`` becomes one request of the batch (its session and arena are made now)."""
        if job.cancel.is_set() or not job.future.set_running_or_notify_cancel():
            self._finish(job, error=Cancelled())
            return
        job.started_at = time.perf_counter()
        self.metrics.queue_seconds.labels(job.chat.method).observe(job.started_at - job.queued_at)

        def commit(ids: list[int], logprobs: list | None) -> None:
            if job.cancel.is_set():
                raise Cancelled()
            if job.on_commit is not None:
                job.on_commit(ids, logprobs)

        try:
            stream = self.decoders[job.chat.method].stream(job.chat.request, job.prompt,
                                                            replace(job.options, on_commit=commit))
        except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
            self._finish(job, error=e)
            return
        self._jobs[id(stream)] = job
        self.batch.add(stream)

    def _end(self, job: Job, stream: Stream) -> None:
        if stream.error is not None:
            stream.release()
            self._finish(job, error=stream.error)
            return
        decoded = stream.decoded()
        stream.release()
        self.metrics.decoded(job, decoded, time.perf_counter() - job.queued_at, stream.reused)
        self._finish(job, decoded)

    def _finish(self, job: Job, decoded: Decoded | None = None, error: BaseException | None = None) -> None:
        with self._cond:
            self._live.pop(id(job), None)
        self.metrics.queue_depth.set(self.outstanding)
        if job.future.done():
            return
        if not job.future.running() and not job.future.set_running_or_notify_cancel():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(decoded)

    def text(self, ids: list[int], final: bool = False, stops: tuple[str, ...] = ()) -> str:
        """The response text an answer is made of, the same for every prefix a stream sees and
        for the finished response: no clean-up of spaces (which revises earlier text when a
        later token arrives), and, until ``final``, no multi-byte character still split and
        no tail that may still become one of the ``stops`` (the text ends before a stop)."""
        text = self.fmt.decode(self.tokenizer, ids, clean_up_tokenization_spaces=False)
        return visible(text if final else text.rstrip("\ufffd"), stops, final)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self.worker is not None and self.worker is not threading.current_thread():
            self.worker.join(timeout=60)
