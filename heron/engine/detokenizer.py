"""Output token ids to streamed text, and stop strings.

`IncrementalDetokenizer` decodes a small sliding window of token ids at each step (the prefix/read
offset technique): the window starts at a token boundary the text has already passed cleanly, or a few
prompt tokens before the output, so decoder effects at the start of a text (a SentencePiece leading
space, a skipped special token) never show up in the middle of an output. Byte-level BPE splits Korean,
CJK and emoji into tokens that each hold part of a UTF-8 character; a decode that ends in such a part
ends in U+FFFD, and that tail is held back until the character is complete, so no piece ever carries a
replacement character the full decode would not have.

`StopChecker` finds stop strings in newly added text and says how much trailing text a stream must hold
back while it could still turn into a stop string.

`LogprobTexts` turns the engine's (logprob, rank) pairs into the caller's `Logprob` objects, with each token's
text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from heron.logprobs import Logprob, Logprobs, RawLogprobs

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first output token, so the first output token's text is what it is
# in context (a SentencePiece decoder strips the leading space of whatever token comes first).
PROMPT_CONTEXT_TOKENS = 5

# Tokens that may pile up while the text keeps ending in U+FFFD before the held tail is released as is.
# A character is at most 4 UTF-8 bytes, so valid text completes its characters well within this; a longer
# run means the model emits invalid bytes, and the window must not grow with them (cost per step).
MAX_PENDING_TOKENS = 32


class IncrementalDetokenizer:
    """Turns one sequence's growing output token ids into text pieces that never split a character.

    The concatenated pieces (`text`, after `flush()`) equal `tokenizer.decode(output_ids, ...)` for valid
    UTF-8 output with byte-level BPE tokenizers. With decoders that strip a leading space at the start
    of a text (SentencePiece), the first piece keeps the space it has after the prompt, as a completion
    continuing the prompt should.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = make_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends mid-character; the output's bytes must not complete it (decode(output)
            # would not), so decode without context.
            context, context_text = [], ""
        self._window: list[int] = context  # token ids from the prefix offset on
        self._read = len(context)  # index in _window of the first token whose text is not final yet
        self._prefix_text: str | None = context_text  # decode(_window[:_read]); None until needed
        self._emitted = 0  # chars of the unread tokens' text already returned (held-back tail excluded)
        self._text = ""

    @property
    def text(self) -> str:
        """All text returned so far by `step` and `flush`, for stop-string checks and the final output."""
        return self._text

    def step(self, new_token_ids: list[int]) -> str:
        """Appends newly sampled tokens; returns the text they complete ("" while a character is partial)."""
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        return self._advance(force=len(self._window) - self._read > MAX_PENDING_TOKENS)

    def flush(self) -> str:
        """At the end of the output, returns the held-back tail; an output that really ends mid-character
        yields U+FFFD for it, exactly as `tokenizer.decode` shows it, so nothing is silently dropped."""
        if self._read == len(self._window):
            return ""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        new_text = self._decode(self._window)[len(self._prefix_text) :]
        if new_text.endswith(REPLACEMENT_CHAR) and not force:
            # The last character is incomplete: return what precedes it, keep the window.
            stable = new_text.rstrip(REPLACEMENT_CHAR)
            piece = stable[self._emitted :]
            self._emitted = max(self._emitted, len(stable))
        else:
            # Everything decoded is final: the read offset becomes the new prefix offset.
            piece = new_text[self._emitted :]
            del self._window[: self._read]
            self._read = len(self._window)
            self._prefix_text = None
            self._emitted = 0
        self._text += piece
        return piece


def make_decode(
    tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """`tokenizer.decode` with these options, as a function of the ids. A transformers fast tokenizer
    that does not clean up spaces decodes with its Rust tokenizer alone, so the call goes there directly:
    its Python wrappers cost about 4 of the 5 us of a short decode, paid per sequence and step while
    streaming. Fast tokenizers ignore spaces_between_special_tokens, as their decode() does."""
    if _decodes_through_backend(tokenizer):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


def _decodes_through_backend(tokenizer) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=s)` is exactly
    `tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=s)`: the stock decode of a transformers
    fast tokenizer (no subclass overrides it) with clean_up_tokenization_spaces off."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls._decode is PreTrainedTokenizerFast._decode
        and cls.decode is PreTrainedTokenizerBase.decode
        and not tokenizer.clean_up_tokenization_spaces
    )


class StopChecker:
    """One sequence's stop strings: where the text must be cut, and what a stream must not show yet."""

    def __init__(self, stop: Iterable[str] | None, include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in dict.fromkeys(stop or ()) if s)  # no duplicates, no empty strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max(map(len, self.stop), default=0)
        self._first_chars = {s[0] for s in self.stop}
        self._checked_len = 0  # len(text) at the previous check

    def check(self, text: str, num_new_chars: int | None = None) -> tuple[str, str] | None:
        """Finds the first stop string to end in the new text; returns (text cut there, that stop string).

        Only matches that end within the last `num_new_chars` characters count (default: the characters
        added since the previous call), so older text is not searched again and stays cheap to check.
        Among those, the match that ends first wins (then the longest): the same result as if the text had
        arrived one character at a time, whatever the tokenization. The text is cut before the stop string,
        or after it with include_stop_str_in_output. None when no stop string matched.
        """
        if num_new_chars is None:
            num_new_chars = len(text) - self._checked_len
        self._checked_len = len(text)
        if not self.stop or num_new_chars <= 0:
            return None
        new_start = len(text) - num_new_chars
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s, max(0, new_start - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, s = best
        return (text[:end] if self.include_stop_str_in_output else text[:start]), s

    def holdback(self, text: str) -> int:
        """How many trailing characters of `text` a stream must hold back: the longest suffix that is the
        start of a stop string, which a later token could complete (then it must never have been shown).

        0 with include_stop_str_in_output: a stop string is then shown anyway, so a partial one may be too.
        """
        if self.include_stop_str_in_output or not self.stop:
            return 0
        for k in range(min(len(text), self.max_len - 1), 0, -1):
            if text[-k] not in self._first_chars:
                continue
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0


class LogprobTexts:
    """Makes the caller's Logprobs where outputs are made (in the API process for the server: the engine's step
    sends plain pairs). `decoded_token` is the id decoded alone, as vLLM's (None without a tokenizer), and is
    remembered per id: every position of a request that asks for logprobs names k + 1 tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, positions: list[RawLogprobs | None] | None) -> list[Logprobs | None] | None:
        if positions is None:
            return None
        text = self._text
        return [None if p is None else {t: Logprob(v, r, text(t)) for t, (v, r) in p.items()} for p in positions]

    def _text(self, token: int) -> str | None:
        text = self._texts.get(token)
        if text is None and self.tokenizer is not None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text
