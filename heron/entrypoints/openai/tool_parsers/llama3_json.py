"""Llama 3.1 / 3.2 / 3.3's JSON calls: the whole message is `{"name": "f", "parameters": {...}}` (several
joined by `;`), optionally after `<|python_tag|>`. A message that starts otherwise is content."""

from __future__ import annotations

from heron.entrypoints.openai.tool_parsers.base import PartialCall, ToolParser, after_tokens, read_sequence
from heron.entrypoints.openai.tool_parsers.json_prefix import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def start(self, text: str, final: bool) -> tuple[int, int] | int:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i) or text.startswith("{", i):
            return 0, i
        if not final and PYTHON_TAG.startswith(text[i:]):
            return 0  # blank so far, or the tag beginning
        return len(text)

    def read_calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        return read_sequence(text, i, final, lambda t, j: after_tokens(t, j, ";"))
