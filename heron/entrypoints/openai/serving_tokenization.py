"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count or build prompts."""

from __future__ import annotations

from heron.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from heron.entrypoints.openai.serving_engine import ApiError, OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "Give either prompt or messages.", param="prompt")
        if req.messages is not None:
            # As for chat completions: the rendered template already holds its special tokens.
            text, add_special = self.render(req.messages, req.add_generation_prompt), False
        else:
            text, add_special = req.prompt, req.add_special_tokens
        tokens = self.tokenizer.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(req.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"tokens must be in [0, {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
