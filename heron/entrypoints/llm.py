"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import replace

from tqdm.auto import tqdm

from heron.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    resolve_runner,
)
from heron.engine.llm_engine import LLMEngine
from heron.inputs import PromptType, engine_prompt, prompt_list
from heron.lora_request import LoRARequest
from heron.models.loader import ModelSource
from heron.outputs import BeamSearchOutput, BeamSearchSequence, EmbeddingRequestOutput, RequestOutput
from heron.pooling_params import PoolingParams
from heron.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    check_structured_outputs_config,
)

Prompt = PromptType
Message = dict[str, object]
# One request for LLM.stream: a prompt, its sampling parameters and whether to add special tokens to a text one.
StreamItem = tuple[Prompt, SamplingParams, bool]


class LLM:
    def __init__(
        self,
        model: str | ModelSource | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        swap_space: float = 0.0,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        device: str = "auto",
        scheduling_policy: str = "fcfs",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        disable_cascade_attn: bool = False,
        chat_template: str | None = None,
        load_format: str = "auto",
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        data_parallel_backend: str = "mp",
        quantization: str | None = None,
        trust_remote_code: bool = False,
        tokenizer_mode: str = "auto",
        structured_outputs_config: dict | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        runner: str = "auto",
        task: str | None = None,
        pooler_config: PoolerConfig | dict | None = None,
        override_pooler_config: PoolerConfig | dict | None = None,
    ) -> None:
        """`trust_remote_code` is taken as vLLM takes it, and changes nothing: Heron runs its own code for
        every architecture it supports, never code from the model's folder. `tokenizer_mode` is "auto", the
        one mode (the fast tokenizer where the model has one). `structured_outputs_config` may name the backend,
        "xgrammar" (or "auto"): the one Heron has. Prefills are always chunked
        (`enable_chunked_prefill` True or unset; False is an error). `runner="pooling"` (or vLLM's
        older `task="embed"`) runs the model for embeddings (`embed`), pooled as `pooler_config` says
        (`override_pooler_config`: its older name). `data_parallel_size` > 1: that many engine replicas
        (`data_parallel_backend` mp: local processes; ray: Ray actors, on the cluster of RAY_ADDRESS or a Ray
        already initialized) share the prompts; outputs still come in input order. `revision`,
        `tokenizer_revision`, `download_dir`: how a hub id is fetched (its snapshot, a hub tokenizer's, the
        cache folder). `generation_config` ("auto": the model's generation_config.json, "vllm": none, or a
        folder's) gives requests their default sampling parameters, `override_generation_config` sets some of
        them over it ({"temperature": 0.5})."""
        del trust_remote_code
        if tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode must be 'auto' (vLLM's default, Heron's mode), got {tokenizer_mode!r}.")
        check_structured_outputs_config(structured_outputs_config or {})
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                max_logprobs=max_logprobs,
                chat_template=chat_template,
                load_format=load_format,
                generation_config=generation_config,
                override_generation_config=override_generation_config,
                revision=revision,
                tokenizer_revision=tokenizer_revision,
                download_dir=download_dir,
                quantization=quantization,
                runner=resolve_runner(runner, task),
                pooler_config=PoolerConfig.parse(pooler_config or override_pooler_config),
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching,
                swap_space=swap_space,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                data_parallel_backend=data_parallel_backend,
            ),
            lora=LoRAConfig(enable_lora, max_loras, max_lora_rank, max_cpu_loras),
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            disable_cascade_attn=disable_cascade_attn,
        )
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an EngineConfig made elsewhere (the command line's engine flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        if config.parallel.data_parallel_size > 1:
            from heron.engine.data_parallel_engine import DataParallelLLMEngine

            config.verify()
            self.engine = DataParallelLLMEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (done at exit otherwise)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so that the next requests compute their prompts' KV again (vLLM's name);
        False, with nothing changed, while requests are running."""
        return self.engine.reset_prefix_cache()

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
        """Run every prompt to completion; outputs come back in input order. A prompt is a string, a
        TextPrompt, a TokensPrompt or a list of token ids (heron/inputs.py). `prompts` may also be any other
        iterable (a generator over a big file): it is read as the engine makes room (`generate_iter`), never
        held whole. `lora_request`: one LoRA adapter for all prompts, or one (or None) per prompt."""
        if not isinstance(prompts, (str, list, tuple)):
            if lora_request is not None:
                raise ValueError("lora_request is taken with a list of prompts, not an iterable.")
            bar = tqdm(desc="Processed prompts", disable=not use_tqdm)
            return [bar.update(1) or out for out in self.generate_iter(prompts, sampling_params)]
        return self._generate(prompts, sampling_params, use_tqdm, priority, True, lora_request)

    def generate_iter(
        self,
        prompts: Iterable[Prompt],
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        ordered: bool = True,
        window: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each prompt's final output as it finishes (in input order when `ordered`), reading `prompts`
        (and `sampling_params`, if an iterable) only as the engine makes room: at most `window` requests
        (default 4 x max_num_seqs) are in the engine or held for ordering at once, so memory is bounded
        however long the input. A prompt the engine refuses raises its ValueError; the others are aborted."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = itertools.repeat(sampling_params or self.get_default_sampling_params())
        items = ((prompt, p, True) for prompt, p in zip(prompts, sampling_params))
        for _, out in self.stream(items, ordered, window):
            if isinstance(out, ValueError):
                raise out
            yield out

    def stream(
        self, items: Iterable[StreamItem], ordered: bool = True, window: int | None = None
    ) -> Iterator[tuple[int, RequestOutput | ValueError]]:
        """The driver of `generate_iter`: (input position, final output) for every
        item, or the ValueError that refused it (the others go on). Every step of the engine costs the
        same however many items are still to come: the input is read `window` at a time."""
        window = window or 4 * self.engine.config.scheduler.max_num_seqs
        items = iter(items)
        ids: dict[str, int] = {}  # request id in the engine -> its input position
        held: dict[int, RequestOutput | ValueError] = {}  # finished, waiting for an earlier one (ordered)
        next_out = 0  # ordered: the position to yield next
        position = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(ids) + len(held) < window:
                    item = next(items, None)
                    if item is None:
                        exhausted = True
                        break
                    prompt, params, special = item
                    rid = str(next(self._ids))
                    try:
                        params.verify_vocab(self.engine.model_cfg.vocab_size)
                        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                        self.engine.add_request(rid, prompt, params, add_special_tokens=special)
                        ids[rid] = position
                    except ValueError as e:
                        held[position] = e
                    position += 1
                if not ids and not held:
                    return
                if ids:
                    for out in self.engine.step():
                        if out.finished:
                            held[ids.pop(out.request_id)] = out
                if ordered:
                    while next_out in held:
                        yield next_out, held.pop(next_out)
                        next_out += 1
                else:
                    for k in list(held):
                        yield k, held.pop(k)
        finally:  # a consumer that stops early, or an exception, must not leave requests holding blocks
            for rid in ids:
                self.engine.abort(rid)

    def _generate(self, prompts, sampling_params, use_tqdm, priority, add_special_tokens: bool, lora_request=None):
        prompts = [engine_prompt(p) for p in prompt_list(prompts)]
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

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (a pooling model: runner="pooling"); each output's
        `outputs.embedding` is a list of floats, as vLLM's. `truncate_prompt_tokens` applies to every prompt
        whose PoolingParams leave it unset."""
        if self.engine.pooler_config is None:
            raise ValueError("LLM.embed needs a pooling model: LLM(model, runner='pooling') (or task='embed').")
        prompts = [engine_prompt(p) for p in prompt_list(prompts)]
        params = _per_prompt(
            list(pooling_params) if isinstance(pooling_params, Seq) else pooling_params or PoolingParams(),
            len(prompts),
            "pooling_params",
        )
        if truncate_prompt_tokens is not None:
            params = [
                p if p.truncate_prompt_tokens else replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params
            ]
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, pooling_params=p)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (engine/beam_search.py): its `beam_width` beams, best first, as
        vLLM's `LLM.beam_search` returns them (tokens and text include the prompt's)."""
        sampling = SamplingParams(n=params.beam_width, temperature=0, max_tokens=params.max_tokens, beam_search=params)
        outputs = self._generate(prompts, sampling, use_tqdm, None, add_special_tokens=True)
        tok = self.engine.tokenizer
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=(tokens := out.prompt_token_ids + _beam_tokens(c, params)),
                        logprobs=c.logprobs or [],
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=tok.decode(tokens) if tok is not None else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                ]
            )
            for out in outputs
        ]

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


def _beam_tokens(c, params: BeamSearchParams) -> list[int]:
    """A beam's tokens, its EOS only with include_stop_str_in_output (as vLLM)."""
    ends_with_eos = c.finish_reason == "stop" and not params.include_stop_str_in_output
    return c.token_ids[:-1] if ends_with_eos else c.token_ids


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return value
    return [value] * n
