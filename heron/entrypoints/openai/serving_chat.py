"""POST /v1/chat/completions: messages (and tools) -> the model's chat template (with the generation prompt, or
leaving the last message open under continue_final_message) -> one engine request with n samples (best_of
candidates, of which the n best are kept); with tool calling, each sample's text is read into content and tool
calls as it comes (serving_tools.py), for streams and plain answers alike."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from heron.entrypoints.openai.serving_engine import EventStream, Fragment, OpenAIServing, message_text
from heron.entrypoints.openai.serving_tools import CallExtractor, ToolCalling
from heron.logprobs import Logprobs
from heron.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *, tool_call_parser: str | None = None, response_role: str = "assistant", **common) -> None:
        super().__init__(**common)
        self.tool_call_parser = tool_call_parser  # for tool_choice "auto"; None: not enabled
        self.response_role = response_role  # --response-role: the answer's role after a generation prompt

    async def create(self, req: ChatCompletionRequest, raw: Request) -> ChatCompletionResponse | EventStream:
        model = self.model_name(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        tools = ToolCalling(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser)
        params, max_param = self.chat_sampling_params(req)
        tools.apply(params)
        prompt = self.render(req.messages, req, tools=tools.tools)
        extractors: dict[int, CallExtractor | None] = {}  # per choice, made at its first text
        # As vLLM: the answer's role is --response-role's after a generation prompt, else the last message's
        # (which the answer continues); echo repeats that message's text when the roles match.
        last = req.messages[-1]
        role = self.response_role if req.add_generation_prompt else last.role
        echo = message_text(last) if req.echo and last.role == role else ""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # The template already holds the special tokens (BOS and the like): none are added again by default.
        group = await self.start(
            raw,
            request_id,
            [prompt],
            params,
            req.priority,
            add_special_tokens=req.add_special_tokens,
            prompt_param="messages",
            max_tokens_param=max_param,
            model=model,
            user=req.user,
        )
        if req.stream:
            created = int(time.time())

            def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

            def fragment_chunk(fragment: Fragment) -> ChatCompletionChunk | None:
                piece = self._choice(req, fragment, tools, extractors)
                if not (
                    piece.delta.content
                    or piece.delta.tool_calls
                    or piece.finish_reason
                    or (piece.logprobs and piece.logprobs.content)
                ):
                    return None  # new tokens whose text is held back (a stop string may be starting)
                return chunk([piece])

            # The role first, for each choice; then each one's text as it comes, the finish reason last.
            opening = [
                chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=role, content=echo))])
                for i in range(req.n)
            ]
            options = req.stream_options
            include_usage = options is not None and options.include_usage
            usage_chunk = (lambda usage: chunk([], usage)) if include_usage else None
            continuous = options is not None and options.continuous_usage_stats
            return EventStream(self.events(group, req.n, fragment_chunk, opening, usage_chunk, continuous), group)
        choices: dict[int, ChatCompletionResponseChoice] = {}
        scores: dict[int, float] = {}
        prompt_logprobs = None

        def add(fragment: Fragment) -> None:
            nonlocal prompt_logprobs
            piece = self._choice(req, fragment, tools, extractors)
            choice = choices.get(piece.index)
            if choice is None:
                choice = choices[piece.index] = ChatCompletionResponseChoice(
                    index=piece.index,
                    message=ChatMessage(role=role, content=echo),
                    logprobs=ChatChoiceLogprobs(content=[]) if req.logprobs else None,
                )
                if req.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = self.prompt_logprobs(fragment[1].prompt_logprobs)
            message = choice.message
            message.content += piece.delta.content or ""
            for d in piece.delta.tool_calls or []:
                if d.id is not None:
                    message.tool_calls = (message.tool_calls or []) + [
                        ToolCall(id=d.id, function=FunctionCall(name=d.function.name, arguments=""))
                    ]
                message.tool_calls[d.index].function.arguments += d.function.arguments
            if message.tool_calls and piece.finish_reason is not None:
                message.content = message.content or None
            choice.finish_reason = piece.finish_reason
            if fragment[2].cumulative_logprob is not None:
                scores[piece.index] = fragment[2].cumulative_logprob
            if piece.logprobs is not None:
                choice.logprobs.content += piece.logprobs.content

        usage = await self.answer(raw, group, params.n, add)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=self.best(choices, scores, params.n, req.n),
            usage=usage,
            prompt_logprobs=prompt_logprobs,
        )

    def chat_sampling_params(self, req: ChatCompletionRequest) -> tuple[SamplingParams, str]:
        """The request's SamplingParams, and the field its length limit came from (max_completion_tokens, or
        the older max_tokens), which errors name."""
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(
            req,
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            renames={"max_tokens": max_param, "logprobs": "top_logprobs"},
        )
        return params, max_param

    def _choice(
        self,
        req: ChatCompletionRequest,
        fragment: Fragment,
        tools: ToolCalling,
        extractors: dict[int, CallExtractor | None],
    ) -> ChatCompletionStreamChoice:
        """A sample's news as a choice: a stream's chunk, or a piece of the plain answer. With tool calling,
        its text goes through the choice's extractor, which makes it content and call deltas."""
        index, _, c = fragment
        text, finish_reason, calls = c.text, c.finish_reason, None
        if index not in extractors:
            extractors[index] = tools.extractor()
        if (extractor := extractors[index]) is not None:
            text, deltas = extractor.feed(c.text, final=finish_reason is not None)
            calls = [
                DeltaToolCall(
                    index=d.index,
                    id=d.id,
                    type="function" if d.id is not None else None,
                    function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
                )
                for d in deltas
            ] or None
            if finish_reason == "stop" and extractor.calls_sent:
                finish_reason = "tool_calls"
        return ChatCompletionStreamChoice(
            index=index,
            delta=DeltaMessage(content=text or None, tool_calls=calls),
            finish_reason=finish_reason,
            logprobs=self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
        )

    def _logprobs(self, token_ids: list[int], lps: list[Logprobs] | None, k: int) -> ChatChoiceLogprobs:
        content = []
        for tok, lp in zip(token_ids, lps or []):
            s = lp[tok].decoded_token
            top = [
                ChatTopLogprob(token=v.decoded_token, logprob=v.logprob, bytes=list(v.decoded_token.encode()))
                for v in self.top_logprobs(lp, k)
            ]
            content.append(ChatTokenLogprob(token=s, logprob=lp[tok].logprob, bytes=list(s.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)
