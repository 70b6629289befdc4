"""Tool calling through `heron serve` and the clients people use with it. The embedded SmolLM2 is too small
to choose tools, so the calls' shape is forced with tool_choice "required" or a named function (a grammar);
"auto" is exercised as far as the model goes (it answers in text), its parsers by their own tests."""

from __future__ import annotations

import json

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
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
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

    after_tool, none, auto = parallel(
        lambda: create(messages=HISTORY),
        lambda: create(messages=ASK, tool_choice="none"),
        lambda: create(messages=ASK, tool_choice="auto"),
    )
    for r in (after_tool, none, auto):
        [choice] = r.choices
        assert choice.message.content and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")


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
