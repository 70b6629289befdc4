"""Per-request parameters of a pooling model's request (`LLM.embed`, `POST /v1/embeddings`), named as vLLM's
`PoolingParams`."""

from __future__ import annotations

from dataclasses import dataclass

from heron.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first d of the embedding (a matryoshka model only: one whose config.json declares
    `matryoshka_dimensions` or `is_matryoshka`); `normalize`: L2-normalise it (None: the model's pooler config,
    true unless --pooler-config says otherwise); `truncate_prompt_tokens`: keep only the prompt's last k tokens
    (-1: max_model_len of them), so that a long input is cut instead of refused."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}.")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens that are pooled: its last truncate_prompt_tokens, or all of them."""
        if self.truncate_prompt_tokens is None:
            return ids
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({max_model_len}), or -1 for it."
            )
        return ids[-keep:]


# What the scheduler reads of a pooling request (engine/pooling.py): one draw, which the pooler takes instead of
# a sampler, and its output only at the end.
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
