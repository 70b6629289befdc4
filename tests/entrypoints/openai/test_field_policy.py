"""Every request field of OpenAI's and vLLM's schemas is implemented, accepted and ignored as documented, or
refused with a 400 naming it: never silently dropped."""

from __future__ import annotations

import typing
from pathlib import Path

import httpx
import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from heron.entrypoints.openai.field_policy import NOT_SUPPORTED
from heron.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    IgnoredFields,
    request_fields,
)
from heron.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from heron.entrypoints.openai.protocol_responses import ResponsesRequest
from tests.entrypoints.openai.remote_server import API_KEY, MODEL
from tests.entrypoints.openai.vllm_fields import CHAT_EXTRA, COMPLETION_EXTRA, EMBEDDING_EXTRA

pytestmark = pytest.mark.slow

IGNORED = set(IgnoredFields.model_fields)  # documented in docs/server.md

SCHEMAS = {
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase)) | set(CHAT_EXTRA),
    ),
    "/v1/completions": (
        CompletionRequest,
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | set(COMPLETION_EXTRA),
    ),
    "/v1/responses": (
        ResponsesRequest,
        {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
        set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)),
    ),
    # (refused as a body before any route: the walk needs no pooling server)
    "/v1/embeddings": (
        EmbeddingRequest,
        {"model": MODEL, "input": "Hi"},
        set(typing.get_type_hints(embedding_create_params.EmbeddingCreateParams)) | set(EMBEDDING_EXTRA),
    ),
}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.mark.parametrize("path", SCHEMAS)
def test_every_field_is_implemented_or_refused(server, path):
    model, base, fields = SCHEMAS[path]
    refused = sorted(fields - set(model.model_fields))
    assert refused, "the walk must refuse something"
    for name in refused:
        r = _post(server, path, {**base, name: 1})
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == name and f"'{name}'" in error["message"], error
        assert name in NOT_SUPPORTED, f"{name}: a field of OpenAI's or vLLM's schema says why it is refused"
    # The rest are model fields: implemented (test_vllm_compat.py, test_responses.py and the endpoint tests
    # show their effect) or in the allow-list of ignored ones, which docs/server.md names.


def test_the_ignored_fields_are_documented():
    docs = (Path(__file__).parents[3] / "docs" / "server.md").read_text()
    assert IGNORED == {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
    assert all(f"`{name}`" in docs for name in IGNORED)


def test_refusal_table_holds_only_undeclared_fields():
    # A field leaves NOT_SUPPORTED when a request model declares it (at the merge of the branch that
    # implements it); both at once would make its refusal dead text. truncate_prompt_tokens is the one field
    # declared by /v1/embeddings whose refusal the generation endpoints still give.
    assert set(NOT_SUPPORTED) & request_fields() == {"truncate_prompt_tokens"}
    assert "truncate_prompt_tokens" in EmbeddingRequest.model_fields
    assert "truncate_prompt_tokens" not in set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)


def test_unknown_fields_nulls_and_ignored_ones(server):
    chat = SCHEMAS["/v1/chat/completions"][1]
    cases = [
        ({**chat, "functions": [{"name": "f"}]}, "functions", "use `tools`"),
        ({**chat, "frobnicate": True}, "frobnicate", "not a field Heron knows"),
        ({**chat, "messages": [{"role": "user", "content": "Hi", "colour": "red"}]}, "messages.[0].colour", "colour"),
        ({**chat, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "'x'"),
        ({**chat, "store": True}, "store", "keeps no completions"),
        ({**chat, "priority": 1}, "priority", "--scheduling-policy priority"),
    ]
    for body, param, words in cases:
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"]
    # null asks for nothing; the allow-list is accepted and ignored
    ok = _post(
        server,
        "/v1/chat/completions",
        {
            **chat,
            "tools": None,
            "user": "u1",
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "safety_identifier": "s",
        },
    )
    assert ok.status_code == 200, ok.text
