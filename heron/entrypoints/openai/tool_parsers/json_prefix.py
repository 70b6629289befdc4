"""Reading JSON that is still being generated: where a value ends, or that the text stops inside it, or that
no continuation can make it valid. The streaming tool-call parsers need this to know, after every token,
which part of a call is settled (a complete name, the arguments so far) without waiting for its end."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_LITERALS = ("true", "false", "null")


class Invalid(ValueError):
    """No continuation of the text makes this JSON."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i], or None when the text ends inside it."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c == "{":
        return object_members(s, i)[0]
    if c == "[":
        return array_end(s, i)
    if c == "-" or c.isdigit():
        j = _NUMBER_CHARS.match(s, i).end()
        if j == len(s):
            return None  # more digits may follow
        if _NUMBER.fullmatch(s, i, j) is None:
            raise Invalid(f"bad number at {i}")
        return j
    for lit in _LITERALS:
        if s.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(s[i:]):
            return None
    raise Invalid(f"unexpected {c!r} at {i}")


def string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def array_end(s: str, i: int) -> int | None:
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "]":
        return j + 1
    while True:
        j = value_end(s, j)
        if j is None:
            return None
        j = skip_ws(s, j)
        if j >= len(s):
            return None
        if s[j] == "]":
            return j + 1
        if s[j] != ",":
            raise Invalid(f"expected , or ] at {j}")
        j = skip_ws(s, j + 1)


Members = dict[str, tuple[int, int | None]]  # key -> (value start, value end or None while unfinished)


def object_members(s: str, i: int) -> tuple[int | None, Members]:
    """The end of the object at s[i] (None: unfinished) and the spans of its members' values so far."""
    if s[i] != "{":
        raise Invalid(f"expected an object at {i}")
    members: Members = {}
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return j + 1, members
    while j < len(s):
        if s[j] != '"':
            raise Invalid(f"expected a key at {j}")
        key_end = string_end(s, j)
        if key_end is None:
            break
        key = s[j + 1 : key_end - 1]
        j = skip_ws(s, key_end)
        if j >= len(s):
            break
        if s[j] != ":":
            raise Invalid(f"expected : at {j}")
        start = skip_ws(s, j + 1)
        end = value_end(s, start)
        members[key] = (start, end)
        if end is None:
            break
        j = skip_ws(s, end)
        if j >= len(s):
            break
        if s[j] == "}":
            return j + 1, members
        if s[j] != ",":
            raise Invalid(f"expected , or }} at {j}")
        j = skip_ws(s, j + 1)
    return None, members
