"""POST /v1/responses through the openai SDK: plain, streamed (its typed events), and what it refuses."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.remote_server import API_KEY, MODEL, parallel

pytestmark = pytest.mark.slow


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
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, None),
    ],
)
def test_refusals(server, extra, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **extra}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
