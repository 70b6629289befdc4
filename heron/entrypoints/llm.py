"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import replace

from tqdm.auto import tqdm

from heron.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from heron.engine.llm_engine import LLMEngine
from heron.lora_request import LoRARequest
from heron.models.loader import ModelSource
from heron.outputs import RequestOutput
from heron.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    def __init__(
        self,
        model: str | ModelSource | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        swap_space: float = 0.0,
        seed: int = 0,
        device: str = "auto",
        scheduling_policy: str = "fcfs",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        chat_template: str | None = None,
        load_format: str = "auto",
        tensor_parallel_size: int = 1,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                chat_template=chat_template,
                load_format=load_format,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching,
                swap_space=swap_space,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, policy=scheduling_policy
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            lora=LoRAConfig(enable_lora, max_loras, max_lora_rank, max_cpu_loras),
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
        )
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an EngineConfig made elsewhere (the command line's engine flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (done at exit otherwise)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a string or a
        list of token ids. `lora_request`: one LoRA adapter for all prompts, or one (or None) per prompt."""
        return self._generate(prompts, sampling_params, use_tqdm, priority, True, lora_request)

    def _generate(self, prompts, sampling_params, use_tqdm, priority, add_special_tokens: bool, lora_request=None):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        priority = _per_prompt(list(priority) if priority is not None else 0, len(prompts), "priority")
        loras = _per_prompt(
            list(lora_request) if isinstance(lora_request, Seq) else lora_request, len(prompts), "lora_request"
        )
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, loras):
                p.verify_vocab(self.engine.model_cfg.vocab_size)
                ids.append(str(next(self._ids)))
                self.engine.add_request(
                    ids[-1], prompt, p, priority=prio, add_special_tokens=add_special_tokens, lora_request=lora
                )
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params=None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                c, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            for c in conversations
        ]
        # The template already holds any BOS token: tokenize without adding special tokens again.
        return self._generate(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:  # an exception mid-run must not leave requests holding blocks
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return value
    return [value] * n
