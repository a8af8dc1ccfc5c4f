"""The OpenAI chat-completions API over an ``Engine`` (``engine.py``): ``POST
/v1/chat/completions`` (what ``protocol.py`` reads: messages, tools, structured outputs,
sampling fields, stop, logprobs, stream), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus). ``create_app`` builds it; ``BackgroundServer`` runs it on a thread of this process
(tests and ``benchmarks/serve_bench.py``); ``infer/serve.py`` is the command line.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from infer.serving.engine import Cancelled, Engine, Job
from infer.serving.message import MessageStream, finish_reason, message
from infer.serving.protocol import (APIError, chunk, completion, logprobs_content, parse_body, parse_chat_request,
                                    usage)

T = TypeVar("T")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="SchemaFill", summary="Slot-parallel speculative decoding behind the OpenAI API")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:  # never takes the server down
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "models": list(engine.models), "outstanding": engine.outstanding,
                "decoding": engine.decoding, "max_batch": engine.cfg.max_batch, "queue_size": engine.cfg.queue_size}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": engine.created,
                                            "owned_by": "schemafill", "method": method}
                                           for m, method in engine.models.items()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        try:
            chat = parse_chat_request(parse_body(await request.body()), engine.models, cid,
                                      engine.cfg.decode.temperature, engine.fmt)
            job = await asyncio.to_thread(engine.prepare, chat)  # tokenizing, compiling a grammar: off the loop
        except APIError as e:
            engine.metrics.requests.labels("", str(e.status)).inc()  # refused before a method was chosen
            raise
        created, call_id = int(time.time()), (lambda i: f"call_{cid[9:]}_{i}")
        parse_calls = chat.tool_choice != "none" and not chat.structured  # a structured answer is content
        if chat.stream:  # queued (or refused with 503) before the stream's 200 goes out
            loop, texts = asyncio.get_running_loop(), asyncio.Queue()

            def committed(ids: list[int], logprobs: list | None) -> None:
                # the ids only go along with their logprobs (copies: the decode goes on appending)
                seen = (engine.text(ids, stops=chat.stops), *(((), None) if logprobs is None else
                                                              (list(ids), list(logprobs))))
                loop.call_soon_threadsafe(texts.put_nowait, seen)

            future = engine.submit(job, committed)
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(texts.put_nowait, None))
            return StreamingResponse(_stream(engine, job, future, texts, cid, created, call_id, parse_calls),
                                     media_type="text/event-stream")
        future = engine.submit(job)
        watch = asyncio.create_task(_watch_disconnect(request, job))
        try:
            decoded = await asyncio.wrap_future(future)
        except Cancelled:
            engine.metrics.requests.labels(chat.method, "499").inc()
            return Response(status_code=499)
        except Exception:
            engine.metrics.requests.labels(chat.method, "500").inc()
            raise
        finally:
            watch.cancel()
        engine.metrics.requests.labels(chat.method, "200").inc()
        text = engine.text(decoded.ids, final=True, stops=chat.stops)
        msg = message(text, call_id, parse_calls, engine.fmt)
        scores = None if decoded.logprobs is None else logprobs_content(engine.tokenizer, decoded.ids,
                                                                          decoded.logprobs)
        return completion(cid, created, chat.model, msg, finish_reason(msg, decoded.stop, text, engine.fmt),
                          usage(len(job.prompt), len(decoded.ids), decoded.target_calls, chat.method), scores)

    return app


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` when its client goes away (its place in the queue is then freed)."""
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(0.1)


async def _stream(engine: Engine, job: Job, future: Future, texts: asyncio.Queue, cid: str, created: int,
                  call_id: Any, parse_calls: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format: the response after every round (``texts``,
    None once the decode ``future`` is done), as deltas."""
    chat, stream = job.chat, MessageStream(call_id, parse_calls, engine.fmt)
    scored = 0  # committed tokens whose logprobs went out

    def event(delta: dict, finish: str | None = None, ids: list[int] = (), logprobs: list | None = None) -> str:
        """A chunk; the logprobs of tokens committed since the last one that carried any ride on it."""
        nonlocal scored
        lp = None
        if logprobs is not None and len(logprobs) > scored:
            lp = logprobs_content(engine.tokenizer, ids[scored:len(logprobs)], logprobs[scored:])
            scored = len(logprobs)
        return _sse(chunk(cid, created, chat.model, delta, finish, logprobs=lp))

    status = "200"
    try:
        yield event({"role": "assistant"})
        while (seen := await texts.get()) is not None:
            text, ids, logprobs = seen
            for delta in stream.feed(text):
                yield event(delta, ids=ids, logprobs=logprobs)
        try:
            decoded = future.result()
        except Cancelled:
            status = "499"
            return
        except Exception as e:  # the stream has begun: the error goes in it, then it ends
            status = "500"
            yield _sse(APIError(500, f"decoding failed: {type(e).__name__}: {e}", kind="server_error").body())
            yield "data: [DONE]\n\n"
            return
        text = engine.text(decoded.ids, final=True, stops=chat.stops)
        for delta in stream.feed(text, final=True):
            yield event(delta, ids=decoded.ids, logprobs=decoded.logprobs)
        msg = message(text, call_id, parse_calls, engine.fmt)
        yield event({}, finish_reason(msg, decoded.stop, text, engine.fmt), decoded.ids, decoded.logprobs)
        if chat.include_usage:
            use = usage(len(job.prompt), len(decoded.ids), decoded.target_calls, chat.method)
            yield _sse(chunk(cid, created, chat.model, {}, use=use, choices=False))
        yield "data: [DONE]\n\n"
    except ValueError as e:  # the streamed text was revised: say so in the stream rather than drop it
        status = "500"
        yield _sse(APIError(500, f"streaming failed: {e}", kind="server_error").body())
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
        status = "499"
        raise
    finally:
        job.cancel.set()  # stops the decode at its next round if it is still running
        engine.metrics.requests.labels(chat.method, status).inc()


def serve_while(engine: Engine, drive: Callable[[str], T]) -> T:
    """``drive(url)`` on a thread, as clients of ``engine`` served on a free port, while this
    thread runs the engine's decode loop (``Engine.start`` says why) until ``drive`` returns:
    its result, or what it raised. The engine is closed afterwards (the benches)."""
    result: list[T] = []
    failed: list[BaseException] = []

    def clients(url: str) -> None:
        try:
            result.append(drive(url))
        except BaseException as e:  # noqa: BLE001 - raised again on this thread
            failed.append(e)
        finally:
            engine.close()

    with BackgroundServer(engine, decode_here=True) as server:
        thread = threading.Thread(target=clients, args=(server.url,))
        thread.start()
        engine.run()
        thread.join()
    if failed:
        raise failed[0]
    return result[0]


class BackgroundServer:
    """A server on a thread of this process, on a free port (tests and the benches). The
    engine's decode loop runs on a thread too unless ``decode_here``: then the caller runs
    ``engine.run()`` on its main thread (``Engine.start`` says why that is faster)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 decode_here: bool = False) -> None:
        import uvicorn

        self.engine, self.decode_here = engine, decode_here
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine), host=host, port=port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "BackgroundServer":
        if not self.decode_here:
            self.engine.start()
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
