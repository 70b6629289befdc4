"""The Responses API's output items and stream events without a server: content then calls (what "auto"
with a --tool-call-parser gives, which the embedded model never writes), fed whole or a few characters at
a time, each event valid as the openai SDK's type and adding up to the items."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from heron.entrypoints.openai.serving_responses import OutputItems
from heron.entrypoints.openai.tool_parsers import HermesToolParser

EVENTS = TypeAdapter(ResponseStreamEvent)
TEXT = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


def run(pieces: list[str], finish: str = "stop", tools: bool = True) -> tuple[list, OutputItems]:
    items = OutputItems(HermesToolParser().streaming() if tools else None)
    events = items.start()
    for i, piece in enumerate(pieces):
        events += items.feed(piece, finish if i == len(pieces) - 1 else None)
    typed = [EVENTS.validate_python({"type": k, "sequence_number": n, **d}) for n, (k, d) in enumerate(events)]
    return typed, items


@pytest.mark.parametrize("size", [len(TEXT), 3])
def test_content_then_calls(size):
    events, items = run([TEXT[i : i + size] for i in range(0, len(TEXT), size)])
    message, weather, time = items.items
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in (weather, time)] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "UTC"}),
    ]
    assert all(item.status == "completed" for item in items.items)
    assert len({item.id for item in items.items}) == 3 and weather.call_id != time.call_id

    # Each item opens, grows and closes before the next one opens, at its own output_index.
    opened = [e.item for e in events if e.type == "response.output_item.added"]
    closed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in opened] == [i.id for i in closed] == [i.id for i in items.items]
    assert [i.model_dump(exclude_none=True) for i in closed] == [i.model_dump() for i in items.items]
    owner = [getattr(e, "item_id", None) or getattr(getattr(e, "item", None), "id", None) for e in events]
    spans = []
    for index, item in enumerate(items.items):
        mine = [n for n, who in enumerate(owner) if who == item.id]
        assert mine == list(range(mine[0], mine[-1] + 1)) and all(events[n].output_index == index for n in mine)
        assert events[mine[0]].type == "response.output_item.added" and events[mine[-1]].type.endswith("item.done")
        spans.append(mine)
    assert sum(map(len, spans)) == len(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == message.content[0].text
    for call in (weather, time):
        deltas = [
            e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == call.id
        ]
        [done] = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == call.id]
        assert "".join(deltas) == done.arguments == call.arguments and done.name == call.name


def test_cut_and_empty_answers():
    # Cut inside a call's arguments (its name was out, so it was sent): the call is incomplete, the rest done.
    events, items = run(['Hi <tool_call>\n{"name": "f", "arguments": {"a": ', "1"], finish="length")
    assert [(i.type, i.status) for i in items.items] == [("message", "completed"), ("function_call", "incomplete")]
    assert events[-1].item.status == "incomplete" and items.items[-1].arguments.startswith('{"a":')
    # Nothing written: still one (empty) message, as without tools.
    for tools in (True, False):
        events, items = run([""], tools=tools)
        [message] = items.items
        assert message.content[0].text == "" and events[-1].type == "response.output_item.done"
