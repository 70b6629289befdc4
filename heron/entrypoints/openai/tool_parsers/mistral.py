"""Mistral's calls: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, a JSON array after a special
token (kept in the text for this parser). The same array with no marker is what `tool_choice="required"`
makes the model write (serving_tools.py)."""

from __future__ import annotations

from heron.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ToolParser,
    after_tokens,
    held_marker,
    read_sequence,
)
from heron.entrypoints.openai.tool_parsers.json_prefix import Invalid, skip_ws


class JsonArrayToolParser(ToolParser):
    """Calls as a JSON array of {"name", "arguments"} objects after `marker` ("" : from the start)."""

    name = "json_array"

    def __init__(self, marker: str = "") -> None:
        self.marker = marker

    def start(self, text: str, final: bool) -> tuple[int, int] | int:
        i = text.find(self.marker)
        if i >= 0:
            return i, i
        return len(text) if final else held_marker(text, self.marker)

    def read_calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        j = skip_ws(text, i + len(self.marker))
        if j >= len(text) and not final:
            return []
        if not text.startswith("[", j):
            raise Invalid("the calls are not an array")
        return read_sequence(text, skip_ws(text, j + 1), final, lambda t, k: after_tokens(t, k, ","))


class MistralToolParser(JsonArrayToolParser):
    name = "mistral"
    skip_special_tokens = False

    def __init__(self) -> None:
        super().__init__("[TOOL_CALLS]")
