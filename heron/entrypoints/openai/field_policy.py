"""What the server says about a request field it does not implement: the one table of refusals.

Request bodies are strict (`extra="forbid"` in protocol.py), so a field that no request model declares is a
400 naming it, never silently dropped. This module gives that 400 its reason: fields of OpenAI's or vLLM's
schemas that Heron refuses on purpose, or that another piece of work will bring (those say "not supported
yet"; the field leaves this table when it becomes a model field, and tests/entrypoints/openai/
test_field_policy.py fails while both hold it). Harmless OpenAI fields that are accepted and ignored are model
fields (protocol.IgnoredFields), documented in docs/server.md."""

from __future__ import annotations

_YET = "not supported yet"

NOT_SUPPORTED: dict[str, str] = {
    # OpenAI's deprecated function calling.
    "functions": "not supported: use `tools` (OpenAI's newer form of it)",
    "function_call": "not supported: use `tool_choice` (OpenAI's newer form of it)",
    # Structured outputs: xgrammar is the one backend.
    "guided_decoding_backend": "not supported: xgrammar is the only structured-output backend",
    "guided_whitespace_pattern": "not supported: JSON is generated with xgrammar's default whitespace",
    "structural_tag": _YET,
    # Refused: nothing in Heron could honour them.
    "audio": "not supported: Heron serves text models",
    "modalities": "not supported: Heron serves text models (output is text only)",
    "prediction": "not supported: Heron has no predicted-output (speculative) decoding",
    "web_search_options": "not supported: Heron has no web search",
    "reasoning_effort": "not supported: no served model takes a reasoning effort (use chat_template_kwargs)",
    "verbosity": "not supported: Heron's models have no verbosity setting",
    "moderation": "not supported: Heron has no moderation",
    "prompt_cache_options": "not supported: the prefix cache is automatic (--enable-prefix-caching)",
    "prompt_cache_retention": "not supported: the prefix cache is automatic (--enable-prefix-caching)",
    "documents": "not supported: pass the documents in the messages",
    "chat_template": "not supported per request: start the server with --chat-template",
    "mm_processor_kwargs": "not supported: Heron serves text models",
    "media_io_kwargs": "not supported: Heron serves text models",
    "prompt_embeds": "not supported: prompts are text or token ids",
    "spaces_between_special_tokens": "not supported: special tokens are decoded as the tokenizer joins them",
    # (/v1/embeddings declares it: this reason is the generation endpoints'.)
    "truncate_prompt_tokens": "not supported for generation: a prompt longer than max_model_len is a 400, never cut "
    "(/v1/embeddings takes it)",
    # /v1/embeddings' (vLLM's extras).
    "embed_dtype": "not supported: embeddings are float32",
    "endianness": "not supported: base64 embeddings are little-endian float32, as OpenAI's",
    "logits_processors": "not supported: the server runs no user code",
    "return_tokens_as_token_ids": "not supported",
    "return_token_ids": "not supported: use /tokenize",
    "include_reasoning": "not supported: Heron has no reasoning parser",
    "request_id": "not supported: the server names its requests",
    "cache_salt": "not supported: the prefix cache is shared by all requests",
    "kv_transfer_params": "not supported: Heron has no disaggregated prefill",
    "vllm_xargs": "not supported",
    # The Responses API's.
    "previous_response_id": "not supported: Heron keeps no responses; send the conversation in `input`",
    "conversation": "not supported: Heron keeps no conversations; send the conversation in `input`",
    "background": "not supported: a response is answered within its request",
    "include": "not supported: a response carries its output text and usage only",
    "max_tool_calls": _YET,
    "reasoning": "not supported: Heron has no reasoning parser",
    "truncation": "not supported: an input longer than max_model_len is a 400, never cut",
    "context_management": "not supported: Heron keeps no conversations",
}


def refusal(field: str) -> str:
    """The 400's message for a request field no request model declares."""
    why = NOT_SUPPORTED.get(field)
    if why is None:
        return f"'{field}' is not a field Heron knows (see docs/vllm_compat.md)."
    return f"'{field}' is {why}."
