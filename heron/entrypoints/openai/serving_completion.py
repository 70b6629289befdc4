"""POST /v1/completions: one engine request per prompt, n samples each (best_of candidates, of which the n
best are kept); choice i*n + j is prompt i's sample j, as in OpenAI's API."""

from __future__ import annotations

import uuid

from fastapi import Request

from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from heron.entrypoints.openai.serving_engine import EventStream, Fragment, OpenAIServing
from heron.logprobs import Logprobs
from heron.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> CompletionResponse | EventStream:
        model = self.model_name(req.model)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported.", param="suffix")
        prompts = _prompts(req.prompt)
        echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_lps)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = await self.start(
            raw,
            request_id,
            prompts,
            params,
            req.priority,
            add_special_tokens=req.add_special_tokens,
            prompt_param="prompt",
            model=model,
            user=req.user,
        )
        head = CompletionResponse(id=request_id, model=model, choices=[])
        sent: dict[int, int] = {}  # choice index -> characters so far (echoed prompt included)
        if req.stream:

            def chunk(fragment: Fragment) -> CompletionResponse:
                return head.model_copy(update={"choices": [self._choice(req, fragment, sent)]})

            def usage_chunk(usage: UsageInfo) -> CompletionResponse:
                return head.model_copy(update={"usage": usage})

            options = req.stream_options
            include_usage = options is not None and options.include_usage
            continuous = options is not None and options.continuous_usage_stats
            return EventStream(
                self.events(
                    group, req.n, chunk, usage_chunk=usage_chunk if include_usage else None, continuous_usage=continuous
                ),
                group,
            )
        choices: dict[int, CompletionResponseChoice] = {}
        scores: dict[int, float] = {}

        def add(fragment: Fragment) -> None:
            piece = self._choice(req, fragment, sent)
            if fragment[2].cumulative_logprob is not None:
                scores[piece.index] = fragment[2].cumulative_logprob
            if piece.index not in choices:
                if req.prompt_logprobs is not None:
                    piece.prompt_logprobs = self.prompt_logprobs(fragment[1].prompt_logprobs)
                choices[piece.index] = piece
                return
            choice = choices[piece.index]
            choice.text += piece.text
            choice.finish_reason = piece.finish_reason
            if piece.logprobs is not None:
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(choice.logprobs, name).extend(getattr(piece.logprobs, name))

        usage = await self.answer(raw, group, params.n, add)
        return head.model_copy(update={"choices": self.best(choices, scores, params.n, req.n), "usage": usage})

    def _choice(self, req: CompletionRequest, fragment: Fragment, sent: dict[int, int]) -> CompletionResponseChoice:
        """A sample's news as a choice: a stream's chunk, or a piece of the plain answer. Its first one begins
        with the prompt under `echo`; logprobs in OpenAI's legacy layout, offsets counted in `sent`."""
        index, first_output, c = fragment
        first = index not in sent
        text = c.text
        logprobs = CompletionLogProbs() if req.logprobs is not None else None
        if first and req.echo:
            text = self._prompt_text(first_output) + text
            if logprobs is not None:
                self._add_logprobs(logprobs, first_output.prompt_token_ids, first_output.prompt_logprobs, 0)
        if logprobs is not None:
            self._add_logprobs(logprobs, c.token_ids, c.logprobs, _end(logprobs) if first else sent[index])
        sent[index] = sent.get(index, 0) + len(text)
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _add_logprobs(
        self, into: CompletionLogProbs, token_ids: list[int], lps: list[Logprobs | None] | None, offset: int
    ) -> None:
        """Append tokens in OpenAI's legacy layout: each token's logprob and its top alternatives, sampled
        token included (so up to logprobs + 1 of them). A prompt's first token has none."""
        lps = lps or []
        for j, tok in enumerate(token_ids):
            s = self.token_str(tok)
            lp = lps[j] if j < len(lps) else None
            into.tokens.append(s)
            into.text_offset.append(offset)
            into.token_logprobs.append(lp[tok].logprob if lp is not None else None)
            into.top_logprobs.append({v.decoded_token: v.logprob for v in lp.values()} if lp is not None else None)
            offset += len(s)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _end(lp: CompletionLogProbs) -> int:
    """The text offset just past the last token in `lp`."""
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0
