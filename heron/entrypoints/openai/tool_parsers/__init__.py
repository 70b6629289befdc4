"""Tool-call parsers for `tool_choice="auto"`, one module per format, chosen with `--tool-call-parser`."""

from __future__ import annotations

from heron.entrypoints.openai.tool_parsers.base import (
    StreamingExtractor,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from heron.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from heron.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from heron.entrypoints.openai.tool_parsers.mistral import JsonArrayToolParser, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "JsonArrayToolParser",
    "StreamingExtractor",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
]
