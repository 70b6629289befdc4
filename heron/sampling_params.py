"""Per-request sampling parameters, named and defaulted as vLLM's `SamplingParams`."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field

import numpy as np

_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class Range:
    """A numeric parameter's accepted values: a finite int or float (never a bool) in [low, high], or
    (low, high] with low_open. The server's request schema states the same bounds (protocol.py)."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False

    def check(self, name: str, value) -> None:
        kind = int if self.integer else (int, float)
        ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value > self.high or value < self.low or (self.low_open and value == self.low):
            left = "(" if self.low_open else "["
            what = "an integer" if self.integer else "a number"
            raise ValueError(f"{name} must be {what} in {left}{_fmt(self.low)}, {_fmt(self.high)}], got {value!r}.")


def _fmt(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 2**16:  # the edges of machine integers, as a reader knows them
        exp = x.bit_length() - (x < 0)
        return f"{'-' if x < 0 else ''}2**{exp}" + ("" if abs(x) == 2**exp else " - 1")
    return f"{x:g}"


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's default max_logprobs, the most a request may ask per token (--max-logprobs raises it, checked by the
# engine); a beam search's draws carry at most this many, so its width is at most half of it
DEFAULT_MAX_LOGPROBS = 20
TOKEN_ID = Range(0, INT32_MAX, integer=True)
LOGIT_BIAS = Range(-100.0, 100.0)

# Every numeric field's range, each stated once. Floats stay within what the sampler's float32 holds with
# room (a temperature of 1e39 would be infinite there); ints within the sampler's int64 tensors (top_k and
# seed are copied into them at every step: 2**63 there would crash the step, and with it the engine).
RANGES: dict[str, Range] = {
    "n": Range(1, INT32_MAX, integer=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.01, 100.0),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, INT32_MAX, integer=True),  # -1 and 0: no top-k
    "min_p": Range(0.0, 1.0),
    "seed": Range(INT64_MIN, INT64_MAX, integer=True),
    "max_tokens": Range(1, INT32_MAX, integer=True),
    "min_tokens": Range(0, INT32_MAX, integer=True),
    "logprobs": Range(0, INT32_MAX, integer=True),  # at most the engine's max_logprobs
    "prompt_logprobs": Range(0, INT32_MAX, integer=True),
}
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")  # None: unset


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema (a dict
    or its JSON text), any JSON object, a regular expression, a choice of strings, an EBNF grammar, or a
    structural tag (xgrammar's JSON format for text with constrained parts, which tool calling uses)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(_CONSTRAINTS)
            raise ValueError(f"structured outputs take exactly one of {names}; got {given or 'none'}.")


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")  # the values of vLLM's backend setting that mean Heron's


def check_structured_outputs_config(config: dict) -> None:
    """vLLM's engine-wide structured-outputs settings (`--structured-outputs-config`), as far as Heron has
    them: the backend only, and xgrammar is the one there is. Anything else is a ValueError naming it."""
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        raise ValueError(f"structured outputs config: {', '.join(unknown)} not supported (only backend is).")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured outputs backend {backend!r} is not supported: Heron's one backend is xgrammar.")


@dataclass
class BeamSearchParams:
    """Beam search, as vLLM's `BeamSearchParams` and transformers' `generate(num_beams=beam_width,
    do_sample=False)`: `length_penalty` divides a finished beam's summed logprob by its generated length to
    that power; `early_stopping` is transformers' (False, its default: stop once no running beam can beat
    the worst of `beam_width` finished ones, judged at the current length; True: as soon as `beam_width`
    beams have finished; "never": judged at max_tokens when length_penalty > 0). Greedy only: temperature
    must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # Each beam's draw carries its top 2 * beam_width logprobs, which DEFAULT_MAX_LOGPROBS bounds.
        Range(1, DEFAULT_MAX_LOGPROBS // 2, integer=True).check("beam_width", self.beam_width)
        RANGES["max_tokens"].check("max_tokens", self.max_tokens)
        Range(-10.0, 10.0).check("length_penalty", self.length_penalty)
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (greedy), got {self.temperature!r}.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}.")


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request each step: its cumulative output; only what is new since
    the last output (what the server's engine process sends, so a step's outputs cost the new tokens
    only); or only the final output (the offline `LLM`, which thereby skips per-step output objects and
    per-token detokenization)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be drawn (vLLM's); their logprobs stay the raw ones
    bad_words: list[str] | None = None  # words never to write (vLLM's): each one's last token is banned after the rest
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search instead of sampling (LLM.beam_search, the server's use_beam_search): n of its beams come back.
    beam_search: BeamSearchParams | None = None
    # Filled in by the engine from the tokenizer / generation_config, not by users.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)  # each word's spellings

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()
        if self.logit_bias:
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:  # 0 and -1 both mean "no top-k", as in vLLM
            self.top_k = -1

    def _verify(self) -> None:
        for name, bounds in RANGES.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                bounds.check(name, value)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}.")
        for t in self.stop_token_ids:
            TOKEN_ID.check("stop_token_ids", t)
        for t, b in (self.logit_bias or {}).items():
            TOKEN_ID.check("logit_bias", t)
            LOGIT_BIAS.check("logit_bias", b)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must hold at least one token id (None: every token).")
            for t in self.allowed_token_ids:
                TOKEN_ID.check("allowed_token_ids", t)
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of words (not blank), got {self.bad_words!r}.")
        restricted = [name for name in ("allowed_token_ids", "bad_words") if getattr(self, name) is not None]
        if restricted and (self.beam_search is not None or self.structured_outputs is not None):
            raise ValueError(f"{restricted[0]} cannot be combined with beam search or structured outputs.")
        if len(restricted) == 2:
            raise ValueError("bad_words cannot be combined with allowed_token_ids (they could ban every token).")

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids given here must name tokens of the model: one that never appears would be ignored."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids below the vocabulary size ({vocab_size}), got {bad[0]}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @functools.cached_property
    def allowed_token_array(self) -> np.ndarray:
        """allowed_token_ids as int64, made once: a step copies them in C, however many they are."""
        return np.asarray(self.allowed_token_ids or (), dtype=np.int64)

    @functools.cached_property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Read for every sampled token: computed once (the engine sets eos_token_ids with
        dataclasses.replace, which makes a new object)."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(self.eos_token_ids))
