"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count or build prompts. The
work is the tokenizer's own thread's for long inputs (AsyncLLM.tokenize), so it never stalls streams."""

from __future__ import annotations

from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from heron.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        self._need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "Give either prompt or messages.", param="prompt")
        if req.messages is not None:
            # As for chat completions: the rendered template already holds its special tokens.
            text, add_special, param = self.render(req.messages, req), False, "messages"
        else:
            text, add_special, param = req.prompt, req.add_special_tokens, "prompt"
        if (why := self.limits.check_text(text)) is not None:
            raise ApiError(400, why, param=param)
        tokens = await self.engine.tokenize(text, add_special)
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens, token_strs=strs
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(req.model)
        self._need_tokenizer()
        vocab = self.limits.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise ApiError(400, f"tokens must be in [0, {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=await self.engine.detokenize(req.tokens))

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer.", param="model")
