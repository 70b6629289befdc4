"""The offline LLM's prompts as vLLM takes them (heron/inputs.py): TextPrompt and TokensPrompt dicts, mixed
with strings and token ids, give what the same prompts give as plain strings and lists."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from heron.inputs import TextPrompt, TokensPrompt, engine_prompt, prompt_list

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_prompt_forms():
    assert prompt_list("a") == ["a"] and prompt_list([1, 2]) == [[1, 2]]
    assert prompt_list({"prompt": "a"}) == [{"prompt": "a"}]
    assert prompt_list(["a", [1]]) == ["a", [1]]
    assert engine_prompt(TextPrompt(prompt="a")) == "a" and engine_prompt(TokensPrompt(prompt_token_ids=[3])) == [3]
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, 3, [1, "a"]):
        with pytest.raises(ValueError):
            engine_prompt(bad)


def test_dict_prompts_generate_as_plain_ones(tiny_model_dir):
    # vLLM's keywords for what Heron always does are accepted
    folder = tiny_model_dir("llama")
    vllm_habits = dict(
        trust_remote_code=True,
        enable_chunked_prefill=True,
        tokenizer_mode="auto",
        structured_outputs_config={"backend": "xgrammar"},
    )
    llm = LLM(folder, kv_cache_memory=8 << 20, **vllm_habits)
    ids = llm.get_tokenizer()("Hello there").input_ids
    plain = llm.generate(["Hello there", ids], GREEDY, use_tqdm=False)
    typed = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]
    assert typed[0].prompt == "Hello there" and typed[1].prompt_token_ids == ids
    with pytest.raises(ValueError, match="TextPrompt"):
        llm.generate([{"prompt": 1}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto'"):
        LLM(folder, tokenizer_mode="slow")
    with pytest.raises(ValueError, match="backend 'outlines' is not supported"):
        LLM(folder, structured_outputs_config={"backend": "outlines"})
