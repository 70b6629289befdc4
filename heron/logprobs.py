"""vLLM's `vllm.logprobs`: a token's logprob, rank and text, and the per-position dicts outputs carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """A token's logprob at one position, as vLLM's (`vllm.logprobs.Logprob`): `rank` is 1 + the number of
    vocabulary tokens with a strictly greater logprob (the top k are ranked 1..k in order; a sampled or
    prompt token may rank past k); `decoded_token` is the token id decoded alone (None when the engine has
    no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __reduce__(self) -> tuple:
        # (a slotted dataclass's default state pickles about 2.5 times slower than this tuple of its fields)
        return Logprob, (self.logprob, self.rank, self.decoded_token)


# token id -> its Logprob, for the sampled (or prompt) token and the top alternatives at one position.
Logprobs = dict[int, Logprob]
# The engine's form of a position, token id -> (logprob, rank): plain tuples, cheap to build at each step and to
# send between processes (a Logprob pickles ~4 times slower); Logprob objects are made where outputs are.
RawLogprobs = dict[int, tuple[float, int]]
SampleLogprobs = list[Logprobs]  # CompletionOutput.logprobs: one position per generated token
PromptLogprobs = list[Logprobs | None]  # RequestOutput.prompt_logprobs: None at the first prompt token
