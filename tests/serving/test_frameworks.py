"""Two real agent frameworks drive the server, and their own parsers read its answers: the
OpenAI Agents SDK (``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client) and
LangChain's ``ChatOpenAI``. Each runs a multi-turn tool loop with tools it derives from typed
Python functions (calls parsed, tools run, results sent back as ``tool`` messages, a final
answer), streamed and not, and asks for a Pydantic object as structured output. Whatever the
method behind the model id, the whole transcript must be greedy AR's. A tiny random target and
head; real tokenizer, decoders, HTTP, and the frameworks' own request building and parsing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from infer.serving.app import BackgroundServer
from infer.serving.engine import Engine
from schemafill.config import ServeConfig, to_dataclass
from tests.conftest import compose
from tests.eval.test_infer import tiny_head  # noqa: F401  (fixture)
from tests.serving.test_serve import MODEL, TARGET, metric


SPECULATIVE = ("schemafill", "eagle3")  # each against "ar", the reference
# a forced call closes well within this (decode.close_margin), so every call a framework reads is whole
MAX_TOKENS = 96
SYSTEM = "You are a travel agent. Use the tools to answer."
PROMPT = "Book 2 seats from Paris to Rome, and tell me the weather in Rome in celsius."


@pytest.fixture(scope="module", autouse=True)
def no_telemetry():
    """Nothing leaves this machine, whatever the developer's environment says: no LangSmith or
    Agents SDK traces (the SDK's runs also call set_tracing_disabled)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
            mp.setenv(name, "false")
        mp.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        yield


@pytest.fixture(scope="module")
def served(tiny_target, tiny_head, tmp_path_factory):  # noqa: F811
    """The server on a free port: "<MODEL>" and "<MODEL>:schemafill" decode with SchemaFill,
    "<MODEL>:ar" and "<MODEL>:eagle3" with those methods."""
    tmp = tmp_path_factory.mktemp("frameworks")
    cfg = to_dataclass(compose([f"model.source={tiny_target}", f"head={tiny_head}", f"paths.artifacts={tmp}",
                                f"decode.cost_cache={tmp / 'cost'}", "methods=[ar,eagle3]", "max_batch=2",
                                "queue_size=2", *TARGET], config_name="serve"), ServeConfig)
    engine = Engine(cfg)
    assert {f"{MODEL}:{m}" for m in ("ar", *SPECULATIVE)} <= set(engine.models)
    with BackgroundServer(engine) as server:
        yield server.url
    engine.close()


# ------------------------------------------------------------------ the tools, plain typed functions
def travel_tools(ran: list[tuple[str, dict]]) -> list[Callable[..., str]]:
    """Two tools for a framework to derive schemas from; each logs the arguments it was really
    run with (what the framework parsed), and its result depends on them, so the next turn's
    prompt does too."""

    def book_flight(origin: str, destination: str, passengers: int) -> str:
        """Book seats on a flight.

        Args:
            origin: The city the flight leaves from.
            destination: The city the flight goes to.
            passengers: How many seats to book.
        """
        ran.append(("book_flight", {"origin": origin, "destination": destination, "passengers": passengers}))
        return f"Booked {passengers} seat(s) from {origin} to {destination}."

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city.

        Args:
            city: The city.
            unit: The temperature unit.
        """
        ran.append(("get_weather", {"city": city, "unit": unit}))
        return f"It is 21 degrees {unit} in {city}."

    return [book_flight, get_weather]


@dataclass
class Transcript:
    """What a loop went through: per model turn, the calls (name, raw argument text where the
    framework keeps it, parsed arguments) and the content; the tools' results in order; the
    final answer."""

    turns: list[tuple[tuple[tuple[str, str | None, dict], ...], str]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    final: Any = None

    @property
    def calls(self) -> list[tuple[str, str | None, dict]]:
        return [c for calls, _ in self.turns for c in calls]


def check_calls(transcript: Transcript, schemas: dict[str, dict], ran: list[tuple[str, dict]]) -> None:
    """Every call names a tool that was offered, its arguments are a JSON object (the one its raw
    text says) valid for that tool's schema as the framework sent it, and the tool was run with
    exactly those arguments, in order."""
    assert transcript.calls, "no tool was called: the loop never exercised the framework's call parsing"
    for name, raw, args in transcript.calls:
        assert name in schemas
        assert isinstance(args, dict) and (raw is None or json.loads(raw) == args)
        jsonschema.validate(args, schemas[name])
    assert ran == [(name, args) for name, _, args in transcript.calls]


COUNTERS = {"requests": "schemafill_requests_total", "prompt_tokens": "schemafill_prompt_tokens_total",
            "completion_tokens": "schemafill_completion_tokens_total", "target_calls": "schemafill_target_calls_total"}


def served_by(url: str, model: str, run: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``run()``, and what the server's own counters say the model id's method decoded meanwhile."""
    method = model.split(":")[1] if ":" in model else "schemafill"

    def counts() -> dict[str, float]:
        text = httpx.get(url + "/metrics").text
        return {k: metric(text, name, method=method, **({"status": "200"} if k == "requests" else {}))
                for k, name in COUNTERS.items()}

    before = counts()
    out = run()
    return out, {k: v - before[k] for k, v in counts().items()}


def check_same_work(counts: dict[str, dict[str, float]]) -> None:
    """Every method decoded the same prompts into the same number of tokens (the framework sent
    the same conversation each turn), and SchemaFill did it in fewer target calls than AR: it
    speculated rather than fell back to one token a call. (The tiny random head's drafts are
    rarely worth verifying, so EAGLE-3 is held to equality only.)"""
    for method in SPECULATIVE:
        for k in ("requests", "prompt_tokens", "completion_tokens"):
            assert counts[method][k] == counts["ar"][k], (method, k, counts)
    assert counts["schemafill"]["target_calls"] < counts["ar"]["target_calls"], counts


# ------------------------------------------------------------------ OpenAI Agents SDK
def agents_model(client, model: str):
    from agents import OpenAIChatCompletionsModel

    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def async_client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def agents_loop(url: str, model: str, stream: bool = False) -> tuple[Transcript, dict[str, dict], list, int]:
    """The Agents SDK's own run loop: the first turn must call a tool (tool_choice required);
    after a tool ran the SDK resets tool_choice (reset_tool_choice, its default), so the next
    turn, with the results as ``tool`` messages, answers freely and the run ends on that answer.
    The transcript, the tools' schemas as sent, the tools' own log, and the model responses."""
    from agents import Agent, ItemHelpers, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # nothing leaves this machine
    ran: list[tuple[str, dict]] = []
    # failure_error_function=None: arguments a tool cannot take raise, rather than go back to the model as text
    tools = [function_tool(fn, failure_error_function=None) for fn in travel_tools(ran)]

    async def run():
        client = async_client(url)
        try:
            agent = Agent(name="travel", instructions=SYSTEM, model=agents_model(client, model), tools=tools,
                          model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS))
            if not stream:
                return await Runner.run(agent, PROMPT, max_turns=4)
            result = Runner.run_streamed(agent, PROMPT, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    transcript, pending = Transcript(final=result.final_output), []
    for item in result.new_items:  # a turn's calls come before its tools' outputs
        if isinstance(item, ToolCallItem):
            pending.append((item.raw_item.name, item.raw_item.arguments, json.loads(item.raw_item.arguments)))
        elif isinstance(item, ToolCallOutputItem):
            if pending:
                transcript.turns.append((tuple(pending), ""))
                pending = []
            transcript.results.append(item.output)
        elif isinstance(item, MessageOutputItem):
            transcript.turns.append(((), ItemHelpers.text_message_output(item)))
    assert not pending
    return transcript, {t.name: t.params_json_schema for t in tools}, ran, len(result.raw_responses)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agents_sdk_tool_loop_equals_ar(served, stream):
    """The Agents SDK parses the server's calls, runs its tools, sends their results back and
    finishes on the answer; every call and the answer are AR's, whatever the method, streamed
    (Runner.run_streamed) or not."""
    runs, counts = {}, {}
    for method in ("ar", *SPECULATIVE):
        model = f"{MODEL}:{method}"
        (transcript, schemas, ran, responses), counts[method] = served_by(
            served, model, lambda: agents_loop(served, model, stream))
        check_calls(transcript, schemas, ran)
        assert len(transcript.results) == len(ran)
        # the loop completed: it ended on an answer in words, after the tools' results went back
        assert responses >= 2 and transcript.turns[-1][0] == () and transcript.final == transcript.turns[-1][1]
        assert counts[method]["requests"] == responses  # each turn was decoded by the method its model id names
        runs[method] = transcript
    for method in SPECULATIVE:
        assert runs[method] == runs["ar"], method
    check_same_work(counts)
    if stream:  # streamed equals whole
        assert agents_loop(served, f"{MODEL}:ar")[0] == runs["ar"]


class Trip(BaseModel):
    """A structured answer: the object the response_format's schema asks for."""

    destination: str
    nights: int


def test_agents_sdk_structured_output_equals_ar(served):
    """``Agent(output_type=Trip)`` sends ``response_format: json_schema`` (strict) and parses the
    message content into a Trip; the Trip is AR's whatever the method."""
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled

    set_tracing_disabled(True)

    async def run(model: str):
        client = async_client(served)
        try:
            agent = Agent(name="planner", instructions="Plan the trip.", model=agents_model(client, model),
                          output_type=Trip, model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
            return (await Runner.run(agent, "A week in Rome.", max_turns=1)).final_output
        finally:
            await client.close()

    trips = {m: asyncio.run(run(f"{MODEL}:{m}")) for m in ("ar", *SPECULATIVE)}
    for trip in trips.values():
        assert isinstance(trip, Trip) and Trip.model_validate(trip.model_dump()) == trip
    assert all(trips[m] == trips["ar"] for m in SPECULATIVE)


# ------------------------------------------------------------------ LangChain
def chat_openai(url: str, model: str):
    from langchain_openai import ChatOpenAI

    # temperature 0 said outright (greedy), whatever the server's default; chat completions, not Responses
    return ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0, timeout=120, use_responses_api=False)


def ask(runnable, messages, stream: bool):
    """The AI message: whole (``invoke``), or the chunks of ``stream`` added up as LangChain adds them."""
    if not stream:
        return runnable.invoke(messages)
    total = None
    for chunk in runnable.stream(messages):
        total = chunk if total is None else total + chunk
    return total


def streamed_arguments_agree(ai) -> bool:
    """A streamed message's argument texts, its chunks joined as LangChain joins them, are the
    JSON of the arguments it parsed (a whole message keeps only the parsed ones)."""
    chunks = getattr(ai, "tool_call_chunks", None) or []
    return [json.loads(c["args"]) for c in chunks] == [c["args"] for c in ai.tool_calls]


LANGCHAIN_CHOICES = ("required", "book_flight", "auto", "auto")  # two turns that must call, then free ones


def langchain_loop(url: str, model: str, stream: bool = False) -> tuple[Transcript, dict[str, dict], list]:
    """A hand-written agent loop: a turn that must call a tool (tool_choice required), one that
    must call book_flight (a named tool_choice), each call run and its ToolMessage appended,
    then turns that may answer (auto) until one does. The transcript, the tools' schemas as
    sent, and the tools' own log."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    ran: list[tuple[str, dict]] = []
    tools = {t.name: t for t in map(tool(parse_docstring=True), travel_tools(ran))}
    llm, messages, transcript = chat_openai(url, model), [SystemMessage(SYSTEM), HumanMessage(PROMPT)], Transcript()
    for choice in LANGCHAIN_CHOICES:
        ai = ask(llm.bind_tools(list(tools.values()), tool_choice=choice), messages, stream)
        messages.append(ai)
        assert not ai.invalid_tool_calls, ai.invalid_tool_calls
        if stream:
            assert streamed_arguments_agree(ai)
        calls = tuple((c["name"], None, c["args"]) for c in ai.tool_calls)  # LangChain keeps the parsed ones only
        transcript.turns.append((calls, ai.content))
        if not calls:
            transcript.final = ai.content
            break
        for c in ai.tool_calls:  # a ToolCall in, a ToolMessage (with its tool_call_id) out
            result = tools[c["name"]].invoke(c)
            assert result.tool_call_id == c["id"]
            messages.append(result)
            transcript.results.append(result.content)
    schemas = {name: convert_to_openai_tool(t)["function"]["parameters"] for name, t in tools.items()}
    return transcript, schemas, ran


def test_langchain_tool_loop_equals_ar(served):
    """ChatOpenAI binds the tools, parses the calls into dicts, the loop runs them and sends
    ToolMessages back, and it ends on an answer; every turn is AR's whatever the method."""
    runs, counts = {}, {}
    for method in ("ar", *SPECULATIVE):
        model = f"{MODEL}:{method}"
        (transcript, schemas, ran), counts[method] = served_by(served, model, lambda: langchain_loop(served, model))
        check_calls(transcript, schemas, ran)
        (first, _), (named, _) = transcript.turns[:2]
        assert first and named and {name for name, _, _ in named} == {"book_flight"}  # the forced turns called
        assert transcript.final is not None and transcript.turns[-1][0] == ()  # the loop completed
        assert counts[method]["requests"] == len(transcript.turns)
        runs[method] = transcript
    for method in SPECULATIVE:
        assert runs[method] == runs["ar"], method
    check_same_work(counts)


def test_langchain_streamed_loop_equals_whole(served):
    """``.stream``: the tool-call chunks LangChain accumulates parse to the calls ``invoke``
    parsed, turn by turn (each call's joined argument text to its parsed arguments), and the
    answer is the same, under AR and SchemaFill."""
    for method in ("ar", "schemafill"):
        model = f"{MODEL}:{method}"
        whole = langchain_loop(served, model)[0]
        streamed, schemas, ran = langchain_loop(served, model, stream=True)
        check_calls(streamed, schemas, ran)
        assert streamed == whole, method


def test_langchain_structured_output_equals_ar(served):
    """``with_structured_output(Trip, method="json_schema", strict=True)`` sends
    ``response_format: json_schema`` and parses the content into a Trip: AR's, whatever the method."""
    trips = {m: chat_openai(served, f"{MODEL}:{m}").with_structured_output(Trip, method="json_schema", strict=True)
             .invoke("A week in Rome.") for m in ("ar", *SPECULATIVE)}
    for trip in trips.values():
        assert isinstance(trip, Trip) and Trip.model_validate(trip.model_dump()) == trip
    assert all(trips[m] == trips["ar"] for m in SPECULATIVE)
