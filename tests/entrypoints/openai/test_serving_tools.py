"""A chat request's tool choice, checked and turned into sampling constraints, without a server."""

from __future__ import annotations

import jsonschema
import pytest

from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import ChatCompletionRequest
from heron.entrypoints.openai.serving_tools import NamedCallExtractor, ToolCalling

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def calling(parser: str | None = None, **body) -> ToolCalling:
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
    return ToolCalling(req.tools, req.tool_choice, req.parallel_tool_calls, parser)


def refused(parser: str | None = None, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        calling(parser, **body)
    assert e.value.status == 400
    return e.value


def test_defaults_and_none():
    assert calling().choice == "none" and calling().extractor() is None
    none = calling(tools=[WEATHER], tool_choice="none")
    assert none.tools[0]["function"]["name"] == "get_weather" and none.structured_outputs is None
    assert calling("hermes", tools=[WEATHER]).choice == "auto"


def test_auto_needs_the_flags():
    e = refused(tools=[WEATHER])
    assert "--enable-auto-tool-choice" in e.message and "--tool-call-parser" in e.message
    assert e.param == "tool_choice"
    assert calling("mistral", tools=[WEATHER]).skip_special_tokens is False


def test_bad_choices():
    assert refused(tool_choice="required").param == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in refused(tools=[WEATHER], tool_choice=named).message
    assert refused(tools=[WEATHER, WEATHER], tool_choice="required").param == "tools"


def test_named_choice_is_the_parameters_schema():
    named = calling(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs.json == WEATHER["function"]["parameters"]
    extractor = named.extractor()
    assert isinstance(extractor, NamedCallExtractor)
    _, [head] = extractor.feed('{"city"')
    assert head.name == "get_weather" and head.id.startswith("call_") and head.arguments == '{"city"'


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls(parallel):
    schema = calling(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel).structured_outputs
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(calls[:1], schema.json)
    for bad in ([], [{"name": "get_weather", "arguments": {"city": "Paris"}}], [{"name": "x", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema.json)
    if parallel:
        jsonschema.validate(calls, schema.json)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema.json)


def test_an_unusable_parameters_schema_is_refused():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 1}}}}
    e = refused(tools=[bad], tool_choice={"type": "function", "function": {"name": "f"}})
    assert e.param == "tools" and "JSON schema" in e.message
