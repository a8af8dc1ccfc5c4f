"""Chat-completion requests read into what the decoder needs, and every bad one named."""

from __future__ import annotations

import json

import pytest

from infer.serving.protocol import APIError, chunk, completion, parse_body, parse_chat_request, usage
from schemafill.contract.prompt import render_plain
from schemafill.contract.response_format import HERMES

MODELS = {"tiny": "schemafill", "tiny:ar": "ar"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def body(**over) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **over}


def test_a_request_is_read_as_the_decoders_read_one():
    chat = parse_chat_request(body(temperature=0.7, top_p=0.9, seed=5, max_tokens=64, stream=True,
                                   stream_options={"include_usage": True}), MODELS, "chatcmpl-1", temperature=0.0)
    assert (chat.method, chat.tool_choice, chat.function, chat.temperature, chat.top_p, chat.seed, chat.max_tokens,
            chat.stream, chat.include_usage) == ("schemafill", "auto", None, 0.7, 0.9, 5, 64, True, True)
    assert chat.request.functions == [WEATHER["function"]] and chat.request.id == "chatcmpl-1"
    assert not chat.constrained
    assert parse_chat_request(body(), MODELS, "x", temperature=0.0).temperature == 0.0  # the server's default
    assert parse_chat_request(body(model="tiny:ar"), MODELS, "x").method == "ar"
    named = parse_chat_request(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), MODELS, "x")
    assert named.constrained and named.tool_choice == "function" and named.grammar_functions == [WEATHER["function"]]
    assert parse_chat_request(body(tools=None), MODELS, "x").tool_choice == "none"  # no tools: nothing to call
    nulls = parse_chat_request(body(max_completion_tokens=None, max_tokens=50, n=None, stream=None, seed=None),
                               MODELS, "x")  # null is absent, as in OpenAI's API
    assert (nulls.max_tokens, nulls.stream, nulls.seed) == (50, False, None)


def test_structured_outputs_sampling_fields_stop_and_logprobs_are_read():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat = parse_chat_request(body(tools=None, response_format={"type": "json_schema", "json_schema": {
        "name": "place", "schema": schema, "strict": True}}, stop="\n", logprobs=True, top_logprobs=2, top_k=-1,
        min_p=0.1, frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1, logit_bias={"7": -100}),
        MODELS, "x", temperature=0.0)
    assert chat.structured and chat.request.output == {"name": "place", "schema": schema, "strict": True}
    assert chat.request.slot_functions[0]["parameters"] == schema and chat.request.tools == []
    assert chat.sampling == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.1, "frequency_penalty": 0.5,
                             "presence_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": ((7, -100.0),)}
    assert (chat.stops, chat.logprobs) == (("\n",), 2)
    loose = parse_chat_request(body(response_format={"type": "json_object"}, tool_choice="none"), MODELS, "x")
    assert loose.request.output["strict"] is False and loose.request.tools == []  # any object; tools not offered
    either = parse_chat_request(body(response_format={"type": "json_object"}), MODELS, "x")  # auto: calls or the object
    assert not either.structured and either.request.tools == [WEATHER] and either.request.output is not None
    with pytest.raises(APIError, match="one JSON object") as e:
        parse_chat_request(body(response_format={"type": "json_object"}), MODELS, "x", fmt=HERMES)
    assert e.value.param == "response_format"
    plain = parse_chat_request(body(response_format={"type": "text"}, logprobs=False), MODELS, "x")
    assert not plain.structured and plain.logprobs is None and plain.stops == ()


def test_history_with_tool_calls_and_results_renders_like_the_corpus():
    history = [{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
               {"role": "user", "content": "And in Rome?"}]
    chat = parse_chat_request(body(messages=history), MODELS, "x")
    assert chat.request.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'},
        {"role": "tool", "content": "18 C"}, {"role": "user", "content": "And in Rome?"}]
    text = render_plain(chat.request)
    assert "Tool result: 18 C" in text and text.endswith("Response:\n")


@pytest.mark.parametrize("over, status, param, words", [
    ({"messages": []}, 400, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", "text"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages[0].tool_calls[0].function.arguments", "not a JSON string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     400, "tools[0].function.parameters", "type object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, 400, "tools[1].function.name", "twice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, 400, "tool_choice", "not in tools"),
    ({"tool_choice": "sometimes"}, 400, "tool_choice", "one of"),
    ({"tools": [], "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"max_tokens": 0}, 400, "max_tokens", "positive"),
    ({"max_tokens": -3}, 400, "max_tokens", "positive"),
    ({"temperature": 3}, 400, "temperature", "[0, 2]"),
    ({"top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"n": 2}, 400, "n", "one choice"),
    ({"model": "gpt-4o"}, 404, "model", "not served"),
    ({"stream": "yes"}, 400, "stream", "true or false"),
    ({"seed": 2 ** 64}, 400, "seed", "[0, 2**63)"),
    ({"stop": ["\n", ""]}, 400, "stop", "non-empty"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}},
      "tool_choice": "none"}, 400, "response_format.json_schema.schema", "type object"),
    ({"frequency_penalty": 3}, 400, "frequency_penalty", "[-2, 2]"),
    ({"top_k": 1.5}, 400, "top_k", "integer"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "(0, 10]"),
    ({"logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ({"top_logprobs": 3}, 400, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
])
def test_bad_requests_are_named(over, status, param, words):
    with pytest.raises(APIError) as e:
        parse_chat_request(body(**over), MODELS, "x")
    err = e.value.body()["error"]
    assert e.value.status == status and err["param"] == param and words in err["message"]
    assert err["type"] == "invalid_request_error"


def test_bodies_that_are_not_json_objects():
    for raw, words in ((b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON")):
        with pytest.raises(APIError, match=words) as e:
            parse_body(raw)
        assert e.value.status == 400
    assert parse_body(json.dumps(body()).encode()) == body()


def test_answer_objects():
    use = usage(100, 30, 8, "schemafill")
    assert use == {"prompt_tokens": 100, "completion_tokens": 30, "total_tokens": 130, "target_calls": 8,
                   "accept_length": 3.75, "method": "schemafill"}
    msg = {"role": "assistant", "content": "hi"}
    done = completion("c", 1, "tiny", msg, "stop", use)
    assert done["object"] == "chat.completion" and done["choices"][0]["message"] == msg
    assert chunk("c", 1, "tiny", {"content": "h"})["choices"][0]["delta"] == {"content": "h"}
    last = chunk("c", 1, "tiny", {}, use=use, choices=False)
    assert last["choices"] == [] and last["usage"] == use
