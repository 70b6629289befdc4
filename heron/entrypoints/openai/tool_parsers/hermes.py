"""Hermes-style calls, as Qwen2.5 and Qwen3 write them:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call."""

from __future__ import annotations

from heron.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ToolParser,
    after_tokens,
    held_marker,
    read_sequence,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def start(self, text: str, final: bool) -> tuple[int, int] | int:
        i = text.find(START)
        if i >= 0:
            return i, i
        return len(text) if final else held_marker(text, START)

    def read_calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        return read_sequence(text, after_tokens(text, i, START), final, lambda t, j: after_tokens(t, j, END, START))
