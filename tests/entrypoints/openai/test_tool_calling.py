"""Tool calling through `heron serve` and the clients people use with it. The embedded SmolLM2 is too small
to choose tools, so the calls' shape is forced with tool_choice "required" or a named function (a grammar);
"auto" is exercised as far as the model goes (it answers in text), its parsers by their own tests."""

from __future__ import annotations

import json
from functools import partial

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer, parallel

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "Europe/Paris", "Asia/Seoul"]}},
            "required": ["tz"],
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def test_history_and_text_answers(client):
    """Assistant tool_calls and tool results in the history (LangChain's second turn); "none" and "auto"
    (which this model answers in text) give content and no calls."""

    def create(**kw):
        return client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER], **kw)

    flat = {"type": "function", **WEATHER["function"]}  # the Responses API's shape of the same tool
    after_tool, none, auto, response = parallel(
        lambda: create(messages=HISTORY),
        lambda: create(messages=ASK, tool_choice="none"),
        lambda: create(messages=ASK, tool_choice="auto"),
        lambda: client.responses.create(model=MODEL, input=ASK, tools=[flat], max_output_tokens=8, temperature=0),
    )
    for r in (after_tool, none, auto):
        [choice] = r.choices
        assert choice.message.content and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
    # /v1/responses reads "auto" (its default with tools) with the same --tool-call-parser: the same answer.
    assert response.tool_choice == "auto" and [o.type for o in response.output] == ["message"]
    assert response.output_text == auto.choices[0].message.content


def test_bad_tool_requests(client):
    def status(**kw) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=4, **kw)
        return e.value

    assert status(messages=ASK, tool_choice="required").body["param"] == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    assert status(messages=ASK, tools=[WEATHER], tool_choice=named).body["param"] == "tool_choice"
    broken = json.loads(json.dumps(HISTORY))
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert status(messages=broken, tools=[WEATHER]).body["param"] == "messages"


def assert_valid_calls(choice, count: int | None = None) -> list:
    """Calls as the API promises them: ids, names of the tools, arguments that validate."""
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return calls


def assemble(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """A stream's calls as (name, arguments), checking OpenAI's delta discipline on the way."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for c in chunk.choices:
            assert not (calls and c.delta.content), "no content after a call has started"
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name in PARAMETERS
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][1] += d.function.arguments
            finish = c.finish_reason or finish
    return [tuple(c) for c in calls.values()], finish


def test_named_and_required_choice(client):
    """Under a grammar, the output always parses against the tool's parameters, whatever the seed."""
    create = partial(client.chat.completions.create, model=MODEL, messages=ASK, max_tokens=64, temperature=0.8)
    named = [partial(create, tools=[WEATHER, TIME], tool_choice=NAMED, seed=s) for s in range(3)]
    # (with parallel calls this model adds calls until max_tokens: the array's schema is tested without it)
    required = [
        partial(create, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=s)
        for s in range(3, 5)
    ]
    *named_out, one, two = parallel(*named, *required)
    for r in named_out:
        [call] = assert_valid_calls(r.choices[0], 1)
        assert call.function.name == "get_weather"
    assert_valid_calls(one.choices[0], 1)
    assert_valid_calls(two.choices[0], 1)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_streamed_calls_equal_the_plain_ones(client, choice):
    create = partial(
        client.chat.completions.create,
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=1.0,
        seed=7,
    )
    plain, chunks = parallel(create, lambda: list(create(stream=True)))
    calls = assert_valid_calls(plain.choices[0])
    assert assemble(chunks) == ([(c.function.name, c.function.arguments) for c in calls], "tool_calls")


def test_openai_sdk_round_trip(client):
    """call -> the tool's result -> the final answer, the way the SDK's users write the loop."""
    messages = list(ASK)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    [call] = assert_valid_calls(first.choices[0], 1)
    result = {"city": json.loads(call.function.arguments)["city"], "temperature": 21}
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=16)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None


def test_langchain_and_instructor(server):
    from enum import Enum

    import instructor
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Unit(str, Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Forecast(BaseModel):
        """The forecast asked for."""

        city: str = Field(max_length=16)
        unit: Unit
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=64, max_retries=0
    )
    patched = instructor.from_openai(server.client(), mode=instructor.Mode.TOOLS)
    bound, structured, made = parallel(
        lambda: llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?"),
        lambda: llm.with_structured_output(Forecast, method="function_calling").invoke("Forecast for Paris?"),
        lambda: patched.chat.completions.create(
            model=MODEL, response_model=Forecast, messages=ASK, max_tokens=64, temperature=0, max_retries=0
        ),
    )
    [call] = bound.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], PARAMETERS["get_weather"])
    assert isinstance(structured, Forecast) and isinstance(made, Forecast)
