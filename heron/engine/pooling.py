"""A pooling engine's requests (runner "pooling"): each is its prompt's prefill and nothing more. It runs as a
request of one draw whose step is the pooler's (executor/pooler.py) instead of the sampler's, so the scheduler
treats it as any prompt (chunked, preempted, prefix-cached) and it never enters decode: the step that
computes its last prompt token ends it, and its blocks are freed when that step is read back."""

from __future__ import annotations

import torch

from heron.engine.request import Request
from heron.outputs import EmbeddingOutput, EmbeddingRequestOutput
from heron.pooling_params import PoolingParams


def check_prompt(
    ids: list[int], params: PoolingParams, max_model_len: int, hidden_size: int, matryoshka: list[int] | None
) -> list[int]:
    """The prompt as it will be pooled (its last truncate_prompt_tokens tokens, if asked); ValueError, its
    message starting with the field at fault, for a prompt over max_model_len or dimensions the model was not
    trained for (vLLM's checks)."""
    ids = params.truncate(ids, max_model_len)
    if len(ids) > max_model_len:
        raise ValueError(
            f"The input is {len(ids)} tokens long, but this model's maximum context length (max_model_len) is "
            f"{max_model_len} tokens; shorten it, or pass truncate_prompt_tokens to keep only its last tokens."
        )
    d = params.dimensions
    if d is not None:
        if matryoshka is None:
            raise ValueError(
                "dimensions is not supported by this model: it was not trained for matryoshka representations "
                "(its config.json declares no matryoshka_dimensions), and cutting its embeddings would ruin them."
            )
        if (matryoshka and d not in matryoshka) or d > hidden_size:
            sizes = matryoshka or f"at most {hidden_size}"
            raise ValueError(f"dimensions must be one of this model's matryoshka dimensions ({sizes}), got {d}.")
    return ids


def finish(vector: torch.Tensor, params: PoolingParams, normalize: bool) -> list[float]:
    """A pooled vector as the request asked: its first `dimensions`, then L2-normalised (vLLM's order)."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if normalize if params.normalize is None else params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


def make_output(req: Request) -> EmbeddingRequestOutput:
    """An aborted request's output has an empty embedding."""
    return EmbeddingRequestOutput(
        req.request_id, EmbeddingOutput(req.embedding or []), req.prompt_token_ids, req.is_finished
    )
