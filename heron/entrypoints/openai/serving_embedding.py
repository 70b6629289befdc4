"""POST /v1/embeddings on a pooling server (`heron serve --runner pooling`): one engine request per input,
each the prefill of its prompt pooled into one vector (engine/pooling.py), answered in OpenAI's format."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import Request

from heron.entrypoints.openai.admission import Overloaded
from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.protocol import UsageInfo
from heron.entrypoints.openai.protocol_embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from heron.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing, until_disconnected
from heron.pooling_params import PoolingParams

_PARAMS = ("dimensions", "truncate_prompt_tokens")  # the fields an engine's rejection may name; else `input`


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        model = self.model_name(req.model)
        self._check_policy_fields(req)
        inputs = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else req.input
        if (too_many := self.limits.check_seqs(len(inputs), 1)) is not None:
            raise ApiError(400, too_many[1], param="input")
        if req.truncate_prompt_tokens is None:
            for text in inputs:
                if isinstance(text, str) and (why := self.limits.check_text(text)) is not None:
                    raise ApiError(400, why, param="input")
        try:
            params = PoolingParams(req.dimensions, req.normalize, req.truncate_prompt_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(" ", 1)[0]) from None
        try:
            tickets = self.admission.admit(len(inputs))
        except Overloaded as e:
            raise api_error(e) from None
        request_id = f"embd-{uuid.uuid4().hex}"
        work = [
            asyncio.ensure_future(
                self.engine.encode(text, params, f"{request_id}-{i}", req.priority, req.add_special_tokens)
            )
            for i, text in enumerate(inputs)
        ]
        try:
            outputs = await self._gather(raw, work)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=field if field in _PARAMS else "input") from None
        except ClientDisconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's death, a shutdown: answered as the other endpoints do
            raise api_error(e, "input") from None
        finally:
            for t in tickets:
                t.release()
        data = [
            EmbeddingData(index=i, embedding=_encode(o.outputs.embedding, req.encoding_format))
            for i, o in enumerate(outputs)
        ]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)

    @staticmethod
    async def _gather(raw: Request, work: list[asyncio.Future]) -> list:
        """Every input's output; when one is refused (or the client leaves), the others are aborted."""
        try:
            return await until_disconnected(raw, asyncio.gather(*work))
        except BaseException:
            for w in work:
                w.cancel()
            await asyncio.gather(*work, return_exceptions=True)
            raise


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """base64 as OpenAI's: the float32 values' bytes, little-endian (what the openai SDK decodes by default)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
