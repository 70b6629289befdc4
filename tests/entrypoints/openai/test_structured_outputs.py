"""Structured outputs over the API: response_format (json_schema, json_object), vLLM's structured_outputs and
guided_* fields, the 400s, and the clients users bring (the openai SDK's parse, instructor, langchain-openai)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.openai.remote_server import API_KEY, MODEL


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int


SCHEMA = Pet.model_json_schema()
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


def _chat(client: openai.OpenAI, **extra) -> str:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, seed=0, **extra)
    assert out.choices[0].finish_reason == "stop"
    return out.choices[0].message.content


def test_response_format_json_schema_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    jsonschema.validate(json.loads(_chat(client, response_format=fmt)), SCHEMA)
    out = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=60, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_json_object_structured_outputs_and_guided_fields(client):
    fmt = {"type": "json_object"}  # any object: the model may well not close it in a few tokens
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, seed=0, response_format=fmt)
    text = out.choices[0].message.content
    assert isinstance(json.loads(text), dict) if out.choices[0].finish_reason == "stop" else text.startswith("{")
    assert _chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", _chat(client, extra_body={"guided_regex": "[0-9]{3}"}))
    jsonschema.validate(json.loads(_chat(client, extra_body={"guided_json": SCHEMA})), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_invalid_or_double_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param


def test_openai_sdk_parse(client):
    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=60, seed=1, response_format=Pet)
    assert isinstance(out.choices[0].message.parsed, Pet)


def test_instructor_json_schema_mode(client):
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    pet = patched.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_model=Pet, max_tokens=60, seed=2, max_retries=0
    )
    assert isinstance(pet, Pet)


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, max_tokens=60, seed=3)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet as JSON.")
    assert isinstance(pet, Pet)
