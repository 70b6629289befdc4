"""POST /v1/responses through the openai SDK: plain, streamed (its typed events), function tools and their
round trip, text.format, and what it refuses. The embedded SmolLM2 cannot choose tools, so calls are forced
with a named or "required" tool choice (a grammar), as in test_tool_calling.py; the shared server has no
--tool-call-parser, so "auto" is a 400 here, as on chat."""

from __future__ import annotations

import json
from functools import partial
from typing import Literal

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.entrypoints.openai.remote_server import API_KEY, MODEL, parallel

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EVENTS = TypeAdapter(ResponseStreamEvent)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int


def _post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, **kw
    )


def _events(server, body: dict) -> list:
    """A stream's events, each validated against the openai SDK's pydantic types (strictly, not constructed)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [EVENTS.validate_python(json.loads(line)) for line in lines]


def test_create_and_stream_agree_with_chat(client):
    kw = dict(model=MODEL, instructions="You are terse.", input="Name a colour.", max_output_tokens=5, temperature=0)
    plain, events, chat = parallel(
        lambda: client.responses.create(**kw),
        lambda: list(client.responses.create(stream=True, **kw)),
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
            max_tokens=5,
            temperature=0,
        ),
    )
    text = chat.choices[0].message.content
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == MODEL
    assert plain.output_text == text and plain.status == "incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 5 and plain.usage.input_tokens == chat.usage.prompt_tokens

    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text and events[-1].response.status == "incomplete"


def test_message_items_and_the_stream_helper(client):
    items = [
        {"role": "system", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    with client.responses.stream(model=MODEL, input=items, max_output_tokens=3, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 3


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.[0]"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.[1]"),
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default: needs --enable-auto-tool-choice, as chat
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input"),
    ],
)
def test_refusals(server, extra, param):
    r = _post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if "tools" in extra and extra["tools"][-1]["type"] != "function":
        assert repr(extra["tools"][-1]["type"]) in r.json()["error"]["message"]


def test_function_calls_streamed_and_round_trip(server, client):
    """A named choice and "required": function_call items whose arguments validate, the stream's events (the
    SDK's types) adding up to the plain answer, the response valid as the SDK's Response; then the round
    trip: the call and the client's function_call_output sent back map to chat's assistant tool_calls and
    tool message (the same prompt, token for token, as chat's history)."""
    body = dict(model=MODEL, input=ASK, tools=[WEATHER, TIME], max_output_tokens=64, temperature=0)
    named = {**body, "tool_choice": {"type": "function", "name": "get_weather"}}
    required = {**body, "tool_choice": "required", "parallel_tool_calls": False}
    plain, events, one = parallel(
        lambda: _post(server, named), lambda: _events(server, named), partial(client.responses.create, **required)
    )
    response = Response.model_validate(plain.json())
    assert response.status == "completed" and response.tool_choice.name == "get_weather"
    assert [t.name for t in response.tools] == ["get_weather", "get_time"] and response.parallel_tool_calls
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    [fc] = one.output
    assert fc.type == "function_call" and fc.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(fc.arguments), {"get_weather": WEATHER, "get_time": TIME}[fc.name]["parameters"])

    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert all(e.item_id == added.id and e.output_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == events[-3].arguments == done.arguments == call.arguments
    assert events[-3].name == "get_weather" and done.status == "completed"
    assert events[-1].response.output[0].arguments == call.arguments

    result = json.dumps({"temperature": 21})
    items = [*ASK, call, {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]  # fmt: skip
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    final, chat = parallel(
        lambda: client.responses.create(
            model=MODEL, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0
        ),
        lambda: client.chat.completions.create(
            model=MODEL, messages=history, tools=[chat_tool], tool_choice="none", max_tokens=8, temperature=0
        ),
    )
    assert [o.type for o in final.output] == ["message"] and final.tool_choice == "none"
    assert final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_json_schema_and_sdk_parse(client):
    fmt = {"type": "json_schema", "name": "pet", "schema": Pet.model_json_schema(), "strict": True}
    ask = dict(model=MODEL, input="Describe a pet as JSON.", max_output_tokens=60, temperature=0)
    plain, parsed, obj = parallel(
        lambda: client.responses.create(text={"format": fmt}, **ask),
        lambda: client.responses.parse(text_format=Pet, **ask),
        lambda: client.responses.create(text={"format": {"type": "json_object"}}, **{**ask, "max_output_tokens": 8}),
    )
    assert plain.status == "completed" and plain.text.format.name == "pet"
    jsonschema.validate(json.loads(plain.output_text), fmt["schema"])
    assert isinstance(parsed.output_parsed, Pet)
    assert obj.output_text.startswith("{")
