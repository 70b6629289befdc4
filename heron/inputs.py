"""The prompts the offline `LLM` takes, as vLLM's `vllm.inputs`: a string, a `TextPrompt`
({"prompt": text}), a `TokensPrompt` ({"prompt_token_ids": ids}), or (Heron's shorthand) a list of ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | TextPrompt | TokensPrompt | list[int]


def prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a sequence of them, as a list (a list of ints is one prompt)."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def engine_prompt(prompt: PromptType) -> str | list[int]:
    """What the engine takes: the text, or the token ids. Raises ValueError naming what is wrong."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
            return prompt["prompt_token_ids"]
        raise ValueError(
            f"A prompt dict is a TextPrompt {{'prompt': str}} or a TokensPrompt {{'prompt_token_ids': "
            f"list[int]}}, got the keys {sorted(keys)}."
        )
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise ValueError(f"A prompt is a string, a list of token ids, a TextPrompt or a TokensPrompt, got {prompt!r}.")
