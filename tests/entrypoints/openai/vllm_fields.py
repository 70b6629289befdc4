"""vLLM's request fields beyond OpenAI's (vllm/entrypoints/openai/protocol.py, v0.11: ChatCompletionRequest and
CompletionRequest, "extra parameters" sections), written out so that the schema walk needs no vLLM."""

SAMPLING_EXTRA = [
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
]

CHAT_EXTRA = SAMPLING_EXTRA + [
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "include_reasoning",
]

COMPLETION_EXTRA = SAMPLING_EXTRA + ["add_special_tokens", "prompt_embeds"]

# EmbeddingCompletionRequest's (vllm/entrypoints/pooling: the pooling mixins' fields and EmbedRequestMixin's).
EMBEDDING_EXTRA = [
    "truncate_prompt_tokens",
    "add_special_tokens",
    "priority",
    "request_id",
    "normalize",
    "embed_dtype",
    "endianness",
]
