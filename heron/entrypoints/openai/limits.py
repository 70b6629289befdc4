"""The most one request may ask of this server, once its model is known: checked by the serving code and
stated in /openapi.json, so that a body the schema allows is never refused for one field's value.

Limits fixed for every model (temperature's range, at most 64 stop strings, ...) are in protocol.py."""

from __future__ import annotations

from dataclasses import dataclass

from heron.engine.messages import ServingInfo
from heron.sampling_params import INT64_MAX, INT64_MIN

DEFAULT_MAX_SEQS_PER_REQUEST = 128
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    max_seqs_per_request: int  # prompts x n of one request (--max-seqs-per-request)
    max_n: int  # min(max_seqs_per_request, max_num_seqs): a request's samples run in one batch
    max_prompt_chars: int  # longer text cannot fit in max_model_len tokens
    max_logprobs: int  # the engine's: a request's logprobs, top_logprobs and prompt_logprobs at most

    @classmethod
    def of(cls, info: ServingInfo, max_seqs_per_request: int) -> RequestLimits:
        return cls(
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            max_seqs_per_request=max_seqs_per_request,
            max_n=min(max_seqs_per_request, info.max_num_seqs),
            max_prompt_chars=info.max_model_len * longest_token(info.tokenizer),
            max_logprobs=info.max_logprobs,
        )

    def check_text(self, text: str) -> str | None:
        """Why `text` cannot be a prompt, decided from its length alone before it is tokenized; or None."""
        if len(text) > self.max_prompt_chars:
            return (
                f"The prompt is {len(text)} characters long: no tokenization of it fits in this model's maximum "
                f"context length (max_model_len) of {self.max_model_len} tokens, which holds at most "
                f"{self.max_prompt_chars} characters."
            )
        return None

    def check_seqs(self, num_prompts: int, n: int) -> tuple[str, str] | None:
        """(field, why) when a request asks for more sequences than allowed; or None."""
        if n > self.max_n:
            return "n", f"n must be at most {self.max_n} on this server, got {n}."
        if num_prompts * n > self.max_seqs_per_request:
            return "prompt", (
                f"The request asks for {num_prompts} prompts x n = {n}, {num_prompts * n} sequences: at most "
                f"{self.max_seqs_per_request} per request on this server (--max-seqs-per-request)."
            )
        return None

    def annotate(self, schema: dict, model_names: list[str]) -> None:
        """Write these limits, and the model names served, into an OpenAPI schema of protocol.py's models (in
        place)."""
        models = schema["components"]["schemas"]
        for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
            _set(models[name]["properties"]["model"], enum=model_names)
        _set(models["ResponsesRequest"]["properties"]["model"], enum=model_names)
        _set(models["ResponsesRequest"]["properties"]["max_output_tokens"], maximum=self.max_model_len - 1)
        for param in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            param["schema"]["enum"] = model_names
        text = {"type": "string", "minLength": 1, "maxLength": self.max_prompt_chars}
        token_id = {"type": "integer", "minimum": 0, "maximum": self.vocab_size - 1}
        token_ids = {"type": "array", "items": token_id, "minItems": 1, "maxItems": self.max_model_len - 1}
        max_tokens = {"maximum": self.max_model_len - 1}
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = models[name]["properties"]
            # FastAPI's OpenAPI model holds bounds as floats, and float(2**63 - 1) is 2**63: the exact ones.
            for field in ("seed", "priority"):
                _set(props[field], minimum=INT64_MIN, maximum=INT64_MAX)
            _set(props["n"], maximum=self.max_n)
            _set(props["best_of"], maximum=self.max_n)
            _set(props["min_tokens"], maximum=self.max_model_len - 1)
            _set(props["max_tokens"], **max_tokens)
            _set(props["prompt_logprobs"], maximum=self.max_logprobs)
            props["stop_token_ids"]["anyOf"][0]["items"] = token_id
            props["allowed_token_ids"]["anyOf"][0]["items"] = token_id
            bias = props["logit_bias"]["anyOf"][0]
            values = next(iter(bias.pop("patternProperties").values()))
            bias.update(propertyNames={"pattern": below(self.vocab_size)}, additionalProperties=values)
        models["CompletionRequest"]["properties"]["prompt"]["anyOf"] = [
            text,
            {"type": "array", "items": text, "minItems": 1, "maxItems": self.max_seqs_per_request},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": self.max_seqs_per_request},
        ]
        _set(models["ChatCompletionRequest"]["properties"]["max_completion_tokens"], **max_tokens)
        _set(models["ChatCompletionRequest"]["properties"]["top_logprobs"], maximum=self.max_logprobs)
        _set(models["CompletionRequest"]["properties"]["logprobs"], maximum=self.max_logprobs)
        for name in ("ChatCompletionRequest", "TokenizeRequest"):
            _set(models[name]["properties"]["messages"], maxItems=self.max_model_len)
        content = models["ChatMessageParam"]["properties"]["content"]["anyOf"][0]
        content["maxLength"] = self.max_prompt_chars
        models["TextContentPart"]["properties"]["text"]["maxLength"] = self.max_prompt_chars
        _set(models["TokenizeRequest"]["properties"]["prompt"], maxLength=self.max_prompt_chars)
        models["DetokenizeRequest"]["properties"]["tokens"]["items"] = token_id


def _set(prop: dict, **constraints) -> None:
    """Constrain a property, or the non-null member of an optional one."""
    target = next((s for s in prop.get("anyOf", ()) if s.get("type") != "null"), prop)
    target.update(constraints)


def longest_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest string in the vocabulary (a byte-level
    token's string has a character per byte, and a byte is at most a character of text)."""
    if tokenizer is None:
        return 1
    return max(map(len, tokenizer.get_vocab()), default=1)


def below(n: int) -> str:
    """A regular expression of the decimal integers in [0, n), written without leading zeros."""
    top = str(n - 1)
    alts = ["0"]
    if len(top) > 1:  # every shorter number
        alts.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # same length: equal up to position i, smaller there
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alts.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    if top != "0":
        alts.append(top)
    return "^(" + "|".join(alts) + ")$"
