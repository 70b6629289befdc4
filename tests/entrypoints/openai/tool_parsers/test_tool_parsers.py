"""The tool-call parsers on outputs written as each model family writes them: the plain reading, and a
stream split at every character boundary, whose deltas must add up to the plain reading (the bugs other
servers have: half a name sent, half-JSON arguments, text leaking after a call)."""

from __future__ import annotations

import json

import pytest

from heron.entrypoints.openai.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolParser

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"tz": "Europe/Paris"}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", "The capital is Paris.", "The capital is Paris.", []),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        f'Let me check.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>\nDone, trailing text.',
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    # arguments before the name, nested values, escapes, unicode; cut off before </tool_call> (max_tokens)
    (
        "hermes",
        '<tool_call>{"arguments": {"q": "a \\"b\\" <tool_call>", "n": [1, -2.5e3, {"x": null}], "ok": true}, '
        '"name": "search"}',
        None,
        [("search", '{"q": "a \\"b\\" <tool_call>", "n": [1, -2.5e3, {"x": null}], "ok": true}')],
    ),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
        f'{{"name": "get_time", "parameters": {TIME}}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", 'Paris is in France. {"name": "x"}', 'Paris is in France. {"name": "x"}', []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', None, [("get_weather", WEATHER)]),
    (
        "mistral",
        f'Checking. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "get_time", "arguments": {TIME}}}] extra',
        "Checking.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
]

# Malformed before the name is complete: all content, streamed or not.
MALFORMED = [
    ("hermes", "Sure. <tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": 42, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"nam": "x", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("mistral", "[TOOL_CALLS] oops"),
    ("mistral", "[TOOL_CALLS]"),
]

# Malformed after the name: the plain reading keeps it as content (a stream has sent the call by then).
MALFORMED_LATE = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": nope}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a" 1}}]'),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),
]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed the pieces, check the delta discipline, and assemble what a client would."""
    extractor = parser.streaming()
    content, calls, deltas = "", {}, []
    for k, piece in enumerate(pieces):
        text, new = extractor.feed(piece, final=k == len(pieces) - 1)
        assert not (calls and text), "no content once a call has started"
        content += text
        for d in new:
            deltas.append(d)
            if d.index not in calls:
                assert d.id and d.id.startswith("call_") and d.name, "id and name come first, whole"
                assert d.index == len(calls), "calls come in order"
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None
            calls[d.index][1] += d.arguments
    return content or (None if calls else ""), [tuple(c) for c in calls.values()], deltas


def splits(text: str):
    yield [text]
    yield list(text)  # a character at a time
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract_and_stream(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_")
    for pieces in splits(text):
        assert streamed(parser, pieces)[:2] == (content, calls), pieces


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_is_content(name, text):
    parser = TOOL_PARSERS[name]()
    assert parser.extract(text) == (text, [])
    for pieces in splits(text):
        assert streamed(parser, pieces)[:2] == (text, []), pieces


@pytest.mark.parametrize("name, text", MALFORMED_LATE)
def test_malformed_late_is_content_when_not_streamed(name, text):
    assert TOOL_PARSERS[name]().extract(text) == (text, [])


def test_stream_sends_arguments_as_they_come():
    parser = TOOL_PARSERS["hermes"]()
    text = f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
    _, _, deltas = streamed(parser, list(text))
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    assert len(deltas) > 10 and all(d.arguments for d in deltas[1:])


def test_required_array():
    parser = JsonArrayToolParser()
    text = f'[{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", "arguments": {TIME}}}]'
    expected = (None, [("get_weather", WEATHER), ("get_time", TIME)])
    content, calls = parser.extract(text)
    assert (content, [(c.name, c.arguments) for c in calls]) == expected
    for pieces in splits(text):
        assert streamed(parser, pieces)[:2] == expected
