"""What every tool-call format shares: a model's text is content, then (after the format's start marker) a
run of JSON calls, each an object with a name and an arguments object. One scanner reads a format's text,
finished or not; the plain answer is its reading of the whole text (`extract`), and a stream (`streaming`)
sends the difference between its readings of successive prefixes, so the deltas always add up to the plain
answer.

A stream settles content as soon as no start marker can begin in it (trailing whitespace waits, as the
plain answer drops it before a call), sends a call's id and name once the name is complete, then its
arguments' JSON text as it comes (the raw text, so that the fragments concatenate to the final string).
Text after the last call is dropped. Malformed JSON in the first call makes the whole text content; a
stream can only take that back while the call's name is unfinished (after it, the call has been sent)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from heron.entrypoints.openai.tool_parsers.json_prefix import Invalid, object_members, skip_ws


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Invalid(str(e)) from None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=call_id)


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: its id and name come once, first; then argument fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str  # the arguments' JSON text so far
    done: bool  # the call's object is complete


@dataclass
class Reading:
    content: str
    calls: list[PartialCall]


ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3's JSON calls say "parameters"


def read_call(s: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
    """The call object at s[i] and the index after it (None: unfinished). Raises Invalid for a call that
    cannot be one: not an object, a name that is not a string, arguments that are not an object."""
    if i >= len(s):
        if final:
            raise Invalid("no call after the start marker")
        return PartialCall(None, "", done=False), None
    end, members = object_members(s, i)
    name = None
    if "name" in members:
        start, stop = members["name"]
        if s[start : start + 1] not in ("", '"'):
            raise Invalid("the name is not a string")
        if stop is not None:
            name = _loads(s[start:stop])
    arguments, args_done, has_arguments = "", False, False
    for key in ARGUMENT_KEYS:
        if key in members:
            start, stop = members[key]
            if s[start : start + 1] not in ("", "{"):
                raise Invalid("the arguments are not an object")
            arguments, args_done, has_arguments = s[start : len(s) if stop is None else stop], stop is not None, True
            if args_done:
                _loads(arguments)  # what the scanner lets through (control characters) json may not
            break
    if end is not None or final:
        if name is None or (has_arguments and not args_done):
            raise Invalid("a call needs a complete name and arguments")
        arguments = arguments or "{}"
    return PartialCall(name, arguments, done=end is not None), end


class ToolParser:
    """A format: `start` finds where its calls begin, `read_calls` reads them. Subclasses set `name`."""

    name: str
    skip_special_tokens = True  # False where the start marker is a special token the text must keep

    def start(self, text: str, final: bool) -> tuple[int, int] | int:
        """(end of the content, start of the calls) when the calls have begun; else the length of the text
        that is surely content (the rest may still become a start marker)."""
        raise NotImplementedError

    def read_calls(self, text: str, i: int, final: bool) -> list[PartialCall]:
        """The calls from text[i] (a start marker), stopping at the first that cannot be one."""
        raise NotImplementedError

    def read(self, text: str, final: bool) -> Reading:
        found = self.start(text, final)
        if isinstance(found, int):
            return Reading(text[:found] if final else text[:found].rstrip(), [])
        content_end, calls_start = found
        try:
            calls = self.read_calls(text, calls_start, final)
        except Invalid:
            return Reading(text, [])  # malformed: all content
        return Reading(text[:content_end].rstrip(), calls)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output's content (None when empty beside calls) and its calls."""
        reading = self.read(text, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in reading.calls]
        return (reading.content or None) if calls else reading.content, calls

    def streaming(self) -> StreamingExtractor:
        return StreamingExtractor(self)


def read_sequence(text: str, i: int, final: bool, sep) -> list[PartialCall]:
    """Calls one after another from text[i]; `sep(text, j)` is the index of the next call's object after a
    call ending at j, or None where the calls end (or the text does, for now). Past the first call, one
    that cannot be a call ends the run instead of spoiling the calls before it."""
    calls: list[PartialCall] = []
    while True:
        try:
            call, end = read_call(text, i, final)
        except Invalid:
            if not calls:
                raise
            return calls
        calls.append(call)
        if end is None:
            return calls
        i = sep(text, end)
        if i is None or i >= len(text):
            return calls


class StreamingExtractor:
    """Feeds a stream's text in pieces; each `feed` returns the new content and call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per call sent: (id, length of its arguments sent)

    @property
    def calls_sent(self) -> int:
        return len(self.sent)

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.text += piece
        if not self.text and not final:
            return "", []
        reading = self.parser.read(self.text, final)
        content = reading.content[self.content_sent :] if not self.sent else ""
        self.content_sent += len(content)
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(reading.calls):
            if call.name is None:
                break
            if index == len(self.sent):
                self.sent.append((call_id(), 0))
                deltas.append(ToolCallDelta(index, "", id=self.sent[index][0], name=call.name))
            cid, args_sent = self.sent[index]
            if len(call.arguments) > args_sent:
                new = call.arguments[args_sent:]
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments += new
                else:
                    deltas.append(ToolCallDelta(index, new))
                self.sent[index] = (cid, len(call.arguments))
        return content, deltas


def after_tokens(text: str, i: int, *tokens: str) -> int | None:
    """The index after `tokens` (whitespace around each) from text[i]; None when the text ends first or holds
    something else."""
    for token in tokens:
        i = skip_ws(text, i)
        if not text.startswith(token, i):
            return None
        i += len(token)
    return skip_ws(text, i)


def held_marker(text: str, marker: str) -> int:
    """The length of the text that is surely not the start of `marker` (a suffix that begins it waits)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
