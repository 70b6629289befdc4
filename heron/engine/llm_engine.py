"""The synchronous engine: add requests, step, read outputs. One step = schedule -> execute (launch the
model and sampler on the device) -> update (apply the sampled tokens). `LLM` drives it in a loop; the
server's `AsyncLLM` drives it in a process of its own (engine_core.py).

Length: the one owner of a request's life (add, step, abort) for every kind of request; what each kind does
differently is a module of its own (beam_search.py, pooling.py, structured_output.py)."""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from heron.config import GENERATION_DEFAULTS, EngineConfig, default_max_num_seqs, resolve_device
from heron.distributed import get_tp_world_size
from heron.engine import beam_search, pooling
from heron.engine.block_manager import BlockManager
from heron.engine.output_processor import OutputProcessor
from heron.engine.request import Request, Sequence, SequenceStatus
from heron.engine.scheduler import Scheduler, SchedulerOutput
from heron.executor.inflight import Forward, InflightStep, StepInputs
from heron.executor.model_runner import ModelRunner
from heron.executor.tp_worker import TPWorkers
from heron.lora_request import LoRARequest
from heron.models.config import TransformerConfig
from heron.models.loader import load_configured
from heron.models.pooling import as_causal_lm, matryoshka_dimensions, resolve_pooler_config
from heron.outputs import EmbeddingRequestOutput, RequestOutput
from heron.pooling_params import PREFILL_ONLY, PoolingParams
from heron.sampling_params import DEFAULT_MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams
from heron.stats import EngineStats

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from heron.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Launched(NamedTuple):
    """A step on the device: what was scheduled, and its handle for reading the tokens back."""

    scheduled: SchedulerOutput
    step: InflightStep
    grammar: bool = False  # its rows drew under their grammars' masks: the matchers take its tokens


class Unsampled(NamedTuple):
    """A structured-output step whose forward pass is launched and whose draw waits for its token masks."""

    scheduled: SchedulerOutput
    forward: Forward


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.verify()
        if get_tp_world_size() > 1:  # the layers would be built for that engine's ranks
            raise RuntimeError(
                "A tensor-parallel engine is running in this process: shut it down (LLM.shutdown()) "
                "before starting another engine."
            )
        self.config = config
        self.device = resolve_device(config.device)
        source = load_configured(config.model)
        if config.model.runner == "pooling":  # an embedding model may be saved as its base model, headless
            source = as_causal_lm(source)
        self.model_name = config.model.served_model_name or source.name
        self.tokenizer = source.tokenizer
        if config.model.chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = config.model.chat_template
        self.model_cfg = TransformerConfig.from_hf(source.hf_config)
        self.max_model_len = self._max_model_len(config.model.max_model_len)
        sched = config.scheduler
        sched.max_model_len = self.max_model_len
        if sched.max_num_seqs is None:
            sched.max_num_seqs = default_max_num_seqs(self.device)
        if sched.max_num_batched_tokens is None:
            sched.max_num_batched_tokens = max(8192 if self.device.type == "cuda" else 2048, sched.max_num_seqs)
        # Every layer sliding (Mistral): a sequence holds only its window's blocks (see BlockManager).
        all_sliding = set(self.model_cfg.layer_types) == {"sliding_attention"}
        self.kv_window = self.model_cfg.sliding_window if all_sliding else None
        self.eos_token_ids = _eos_ids(source.generation_config, self.model_cfg, self.tokenizer)
        gen = _default_sampling_config(config.model.generation_config, source.generation_config)
        gen = {**gen, **(config.model.override_generation_config or {})}
        self.generation_defaults = {k: gen[k] for k in GENERATION_DEFAULTS if k in gen}
        # A request's most logprobs per token: max_logprobs -1 is the whole vocabulary (as in vLLM), and none asks
        # for more than the vocabulary (the sampler's top-k)
        vocab = self.model_cfg.vocab_size
        self.max_logprobs = vocab if config.model.max_logprobs == -1 else min(config.model.max_logprobs, vocab)
        SamplingParams(**self.generation_defaults)  # an override out of its range is an error here, at start

        # A pooling model (runner "pooling"): its pooler resolved once, before the runner that builds it.
        self.pooler_config, self.matryoshka = None, None
        if config.model.runner == "pooling":
            config.model.pooler_config = resolve_pooler_config(config.model.model, config.model.pooler_config)
            self.pooler_config = config.model.pooler_config
            self.matryoshka = matryoshka_dimensions(source.hf_config)
        self.pooling_type = self.pooler_config.pooling_type if self.pooler_config is not None else None
        # Tensor parallelism: this process is rank 0; the workers join it before any layer is built.
        tp_size = config.parallel.tensor_parallel_size
        self.tp_workers = TPWorkers(config, self.model_cfg, self.device) if tp_size > 1 else None
        start = functools.partial(self._start_runner, source)
        num_blocks, num_cpu_blocks = start() if self.tp_workers is None else self.tp_workers.run(start)
        bs = config.cache.block_size
        # MEAN and CLS pooling read every prompt token's hidden state: none may come from the prefix cache.
        prefix_caching = config.cache.enable_prefix_caching and self.pooling_type in (None, "LAST")
        self.block_manager = BlockManager(num_blocks, bs, prefix_caching, self.kv_window)
        max_loras = config.lora.max_loras if config.lora.enable_lora else 0
        self.scheduler = Scheduler(sched, self.block_manager, num_cpu_blocks, max_loras)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._make_output = self.output_processor.make_output if self.pooler_config is None else pooling.make_output
        self.requests: dict[str, Request] = {}
        self._inflight: Launched | None = None  # the launched step whose tokens are not read back yet
        self._unsampled: Unsampled | None = None  # a grammar step waiting for its masks (see `advance`)
        self._structured: StructuredOutputManager | None = None  # made with the first constrained request
        self._compiling: dict[str, tuple[Request, Future]] = {}  # requests waiting for their grammar
        self._num_beam_requests = 0  # while any runs, every step is read back at once (beam_search.py)
        self.rng = random.Random(config.model.seed)
        self.stats = EngineStats()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s), %d host blocks for swapping",
            num_blocks,
            bs,
            num_blocks * self.runner.bytes_per_block / 2**30,
            str(self.runner.kv_dtype).removeprefix("torch."),
            num_cpu_blocks,
        )

    def _start_runner(self, source) -> tuple[int, int]:
        """Build the model runner and its KV cache (on every rank, the same blocks); returns the number of
        device blocks and of host blocks for swapping."""
        self.runner = ModelRunner(self.config, source, self.model_cfg, self.device)
        num_blocks = self.runner.num_blocks_for_budget()
        if self.tp_workers is not None:
            num_blocks = self.tp_workers.fewest_blocks(num_blocks, self.device)
        bs = self.config.cache.block_size
        longest = self.max_model_len  # what one sequence may hold at once: all its tokens, or with every layer
        if self.kv_window is not None:  # sliding, its window and the chunk it computes
            longest = min(longest, self.kv_window + self.config.scheduler.max_num_batched_tokens + 2 * bs)
        if num_blocks * bs < longest:
            raise ValueError(
                f"The KV cache holds {num_blocks * bs} tokens, fewer than one sequence may need ({longest}, "
                f"max_model_len {self.max_model_len}): lower max_model_len or give the cache more memory."
            )
        num_cpu_blocks = int(self.config.cache.swap_space * 2**30 // self.runner.bytes_per_block)
        if self.tp_workers is not None:
            self.tp_workers.start(self.runner, num_blocks, num_cpu_blocks)
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.runner.warm_up()
        return num_blocks, num_cpu_blocks

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (done at exit otherwise)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    def _max_model_len(self, asked: int | None) -> int:
        limit = self.model_cfg.max_position_embeddings
        if asked is None:
            return limit
        if not 0 < asked <= limit:
            raise ValueError(f"max_model_len ({asked}) must be in [1, {limit}], the model's max_position_embeddings.")
        return asked

    # -- requests ------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("This engine has no tokenizer: give prompts as token ids.")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> Request:
        """Validate and queue a request. Raises ValueError (naming the lengths) when it cannot fit.
        A chat prompt already holds its special tokens: pass add_special_tokens=False. A text prompt's
        `prompt_token_ids`, when the caller has them (the server tokenizes in its own process), are taken
        as they are instead of tokenizing here. `lora_request`: the LoRA adapter to run with (enable_lora),
        read and checked here (a bad adapter is a ValueError). A pooling engine takes `pooling_params` instead
        of `params` (engine/pooling.py)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        params = params or SamplingParams()
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.max_logprobs:
                raise ValueError(
                    f"{name} ({getattr(params, name)}) is more than this engine's max_logprobs ({self.max_logprobs}; "
                    "--max-logprobs, LLM(max_logprobs=...))."
                )
        if lora_request is not None:
            self.add_lora(lora_request)
        if params.beam_search is not None:
            if params.structured_outputs is not None:
                raise ValueError("structured_outputs cannot be combined with beam search.")
            params = self._beam_params(params)
        grammar = self._compile(params.structured_outputs) if params.structured_outputs is not None else None
        if not isinstance(prompt, str):
            text, ids = None, list(prompt)
        elif prompt_token_ids is None:
            text, ids = prompt, self.tokenize(prompt, add_special_tokens)
        else:
            text, ids = prompt, list(prompt_token_ids)
        if not ids:
            raise ValueError("The prompt is empty.")
        if min(ids) < 0 or max(ids) >= self.model_cfg.vocab_size:  # (min and max: C loops over long prompts)
            raise ValueError(f"prompt token ids must be in [0, {self.model_cfg.vocab_size}).")
        if self.pooler_config is not None or pooling_params is not None:
            return self._add_pooling(request_id, text, ids, pooling_params, arrival_time, priority)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt is {len(ids)} tokens long, but this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens, which must also leave room for "
                f"at least one output token."
            )
        if params.n > self.config.scheduler.max_num_seqs:  # its n samples could never run together
            raise ValueError(f"n ({params.n}) is more than max_num_seqs ({self.config.scheduler.max_num_seqs}).")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({len(ids)} tokens) exceeds "
                f"max_model_len ({self.max_model_len})."
            )
        # max_tokens left out: up to the context (as in vLLM), so every request has a known length limit
        params = replace(params, eos_token_ids=self.eos_token_ids, max_tokens=params.max_tokens or room)
        if params.bad_words:
            params = replace(params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        if (
            params.allowed_token_ids
            and params.min_tokens
            and set(params.allowed_token_ids) <= params.all_stop_token_ids
        ):
            raise ValueError("allowed_token_ids are all stop tokens, and min_tokens asks for other tokens first.")
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        req = Request(
            request_id,
            text,
            ids,
            params,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            seed=seed,
            lora_request=lora_request,
        )
        self.requests[request_id] = req
        if grammar is None:
            self.scheduler.add(req.seqs[0])
        else:
            self._compiling[request_id] = (req, grammar)
        if params.beam_search is not None:
            beam_search.start(req, params.eos_token_ids)
            self._num_beam_requests += 1
        self.stats.prompt_tokens += len(ids)
        return req

    def _add_pooling(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: PoolingParams | None,
        arrival_time: float | None,
        priority: int,
    ) -> Request:
        if self.pooler_config is None:
            raise ValueError("pooling_params need a pooling model: start the engine with runner='pooling'.")
        if params is None:
            raise ValueError(
                "This engine runs its model for embeddings (runner='pooling'): it takes pooling requests "
                "(LLM.embed, /v1/embeddings), not generation; start it without runner='pooling' to generate."
            )
        ids = pooling.check_prompt(ids, params, self.max_model_len, self.model_cfg.hidden_size, self.matryoshka)
        req = Request(
            request_id,
            text,
            ids,
            PREFILL_ONLY,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            pooling_params=params,
        )
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        self.stats.prompt_tokens += len(ids)
        return req

    def _compile(self, params: StructuredOutputsParams) -> Future:
        """Start compiling a request's grammar (ValueError at once if it is invalid)."""
        if self._structured is None:  # (xgrammar is imported, and the tokenizer read, only now)
            from heron.engine.structured_output import StructuredOutputManager

            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer: this engine has none.")
            vocab, seats = self.model_cfg.vocab_size, self.config.scheduler.max_num_seqs
            self._structured = StructuredOutputManager(self.tokenizer, vocab, seats, self.device)
        return self._structured.compile(params)

    def _admit_compiled(self, touched: dict[str, Request]) -> None:
        """Requests whose grammar is compiled join the scheduler, each sequence with its matcher; one whose
        compile failed finishes ("abort", into `touched`; its constraint was validated when it was added, so
        this is rare)."""
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            seq = req.seqs[0]
            if future.exception() is None:
                seq.grammar = self._structured.matcher(future.result(), self.eos_token_ids)
                self.scheduler.add(seq)
                continue
            logger.error("request %s: its grammar did not compile: %s", request_id, future.exception())
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            self._finish_request(req)
            touched[request_id] = req

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it starts the text and as it follows a space. The spaced spelling is kept
        when it has as many tokens as the other: a tokenizer that marks word starts itself (SentencePiece)
        splits a leading space off as a token of its own."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine has none.")
        spellings: dict[tuple[int, ...], None] = {}
        for word in words:
            plain = tuple(self.tokenizer.encode(word.strip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.strip(), add_special_tokens=False))
            spellings[plain] = None
            if len(spaced) == len(plain):
                spellings[spaced] = None
        return tuple(spellings)

    def _beam_params(self, params: SamplingParams) -> SamplingParams:
        """A beam search's params as the engine runs them: greedy draws carrying the logprobs it ranks."""
        beam = params.beam_search
        if params.n > beam.beam_width:
            raise ValueError(f"n ({params.n}) must be at most the beam width ({beam.beam_width}).")
        if beam.beam_width > self.config.scheduler.max_num_seqs:
            raise ValueError(f"beam_width ({beam.beam_width}) is more than max_num_seqs.")
        k = beam_search.num_logprobs(beam, len(self.eos_token_ids))
        if k > DEFAULT_MAX_LOGPROBS:
            raise ValueError(f"beam_width ({beam.beam_width}) is too large for this model's EOS tokens.")
        return replace(
            params,
            temperature=0.0,
            logprobs=k,
            ignore_eos=True,  # the search decides where a beam ends
            include_stop_str_in_output=beam.include_stop_str_in_output,
            stop=[],
            stop_token_ids=[],
            min_tokens=0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            logit_bias=None,
            prompt_logprobs=None,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed at once. Returns its final output, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.aborted = True
        if self._compiling.pop(request_id, None) is not None:  # never scheduled: nothing to free
            req.seqs[0].status = SequenceStatus.FINISHED
            req.seqs[0].finish_reason = "abort"
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._retire(seq)
                if self.runner.pooler is not None:
                    self.runner.pooler.discard(seq.seq_id)
        self._finish_request(req)
        return self._make_output(req)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into the host cache ahead of its requests (vLLM's `add_lora`); a bad one
        is a ValueError naming what is wrong."""
        if self.runner.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True.")
        self.runner.lora.get(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache; its requests still queued read it again when they run."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (BlockManager.reset_prefix_cache); False while a request holds any."""
        return not self.has_unfinished() and self.block_manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        busy = self._inflight is not None or self._unsampled is not None
        return self.scheduler.has_unfinished() or busy or bool(self._compiling)

    # -- the step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput] | list[EmbeddingRequestOutput]:
        """Run one iteration (see `advance`); returns an output for every request that advanced (finished
        ones last time they appear; with RequestOutputKind.FINAL_ONLY, only those). A pooling engine's are
        EmbeddingRequestOutputs, of finished requests only."""
        make_output = self._make_output
        return [
            make_output(r)
            for r in self.advance()
            if r.is_finished or r.params.output_kind is not RequestOutputKind.FINAL_ONLY
        ]

    def advance(self) -> list[Request]:
        """Run one iteration; returns the requests it advanced (those it finished are done with here), whose
        outputs are the caller's to build: `step`'s RequestOutputs, or the engine process's wire tuples.

        The iteration is pipelined: step t is scheduled and launched before step t - 1's tokens are read
        back, so the host's work (scheduling, input preparation, detokenization) overlaps the device's.
        Meanwhile each token of step t - 1 is counted in its sequence's `num_pending`: the scheduler counts
        it, the model runner takes its value on the device, and `_update` appends it. A sequence that turns
        out to have finished with step t - 1's token wastes its row in step t; one that reaches max_tokens
        or max_model_len is known in advance and not scheduled. A step whose tokens the next one needs on
        the host (an n > 1 request forking, repetition penalties) is read back at once.

        Structured outputs (structured_output.py): a step t with rows under a grammar launches its forward
        pass and returns; its draw waits for its token masks, which need step t - 1's tokens (every matcher
        takes its sequence's last token). The next iteration reads step t - 1 back, fills step t's masks (on a
        thread while it schedules step t + 1 and prepares its inputs; a small step's at once), then launches
        step t's sampling and step t + 1's forward: the host's work of two steps runs while step t's forward
        does."""
        touched: dict[str, Request] = {}
        if self._compiling:
            idle = self._inflight is None and self._unsampled is None
            if idle and not self.scheduler.has_unfinished():  # nothing else to do: wait
                wait([f for _, f in self._compiling.values()], timeout=0.1, return_when=FIRST_COMPLETED)
            self._admit_compiled(touched)
        waiting, self._unsampled = self._unsampled, None
        if waiting is not None:  # step t - 1's tokens advance the matchers, and may end sequences, first
            self._read_back_inflight(touched)
            masks = self._structured.fill_bitmask_async(self._grammar_rows(waiting))  # (while t + 1 is scheduled)
        scheduled = self.scheduler.schedule()
        inputs = self._prepare(scheduled)  # (on the host, while the waiting step's forward runs)
        if waiting is not None:
            self._inflight = self._draw(waiting, masks.result())
        launched = self._launch(scheduled, inputs, touched)
        return self._update(launched, touched)

    def _on_ranks(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on rank 0; with tensor parallelism, a worker's failure is named (TPWorkers.run)."""
        return fn(*args) if self.tp_workers is None else self.tp_workers.run(fn, *args)

    def _prepare(self, scheduled: SchedulerOutput) -> StepInputs | None:
        """Commit the step (its tokens' K/V count as computed, its draws as pending) and build its inputs;
        None for an empty step or a pooling engine's (whose runner prepares at launch)."""
        if not scheduled.seqs:
            return None
        now = time.time()
        for seq in scheduled.seqs:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        self.scheduler.commit(scheduled)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return None if self.pooler_config is not None else self._on_ranks(self.runner.prepare, scheduled.batch)

    def _launch(
        self, scheduled: SchedulerOutput, inputs: StepInputs | None, touched: dict[str, Request]
    ) -> Launched | Unsampled | None:
        """Launch the prepared step on the device (on every tensor-parallel rank); returns at once on a GPU. A
        step with a grammar returns unsampled, unless the next step needs its tokens on the host at once."""
        if not scheduled.seqs:
            return None
        if inputs is None:
            return Launched(scheduled, self._on_ranks(self.runner.execute_pooling, scheduled.batch))
        forward = self._on_ranks(self.runner.launch, inputs)
        # (No pass over the step's rows unless some request ever had a grammar: this is the hot path.)
        if self._structured is None or all(s.grammar is None for s in scheduled.seqs):
            return Launched(scheduled, self.runner.sample(forward))
        unsampled = Unsampled(scheduled, forward)
        if not (inputs.read_back_now or self._num_beam_requests):
            return unsampled
        self._read_back_inflight(touched)
        return self._draw(unsampled, self._structured.fill_bitmask(self._grammar_rows(unsampled)))

    @staticmethod
    def _grammar_rows(unsampled: Unsampled) -> list[xgr.GrammarMatcher | None]:
        """The matcher of each sampled row of a grammar step, once its sequences' tokens before it are on the
        host; None for a row without one, or whose sequence has finished meanwhile (it draws unmasked, and its
        draw is dropped)."""
        scheduled = unsampled.scheduled
        return [
            None if s.is_finished else s.grammar
            for s, k in zip(scheduled.seqs, scheduled.batch.num_samples)
            for _ in range(k)
        ]

    def _draw(self, unsampled: Unsampled, masks: torch.Tensor) -> Launched:
        """A grammar step's sampling, under its rows' token masks (`_grammar_rows`' bitmask)."""
        return Launched(unsampled.scheduled, self.runner.sample(unsampled.forward, masks), grammar=True)

    def _read_back_inflight(self, touched: dict[str, Request]) -> None:
        if self._inflight is not None:
            self._read_back([self._inflight], touched)
            self._inflight = None

    def _update(self, launched: Launched | Unsampled | None, touched: dict[str, Request]) -> list[Request]:
        """Read back the step launched before `launched` (and `launched` itself when the next step needs its
        tokens on the host), hand their tokens to their sequences and retire what they finished. Returns
        the requests that advanced (those in `touched`, read back earlier this iteration, too). An unsampled
        `launched` waits for the next iteration, and so does the step before it."""
        if isinstance(launched, Unsampled):
            self._unsampled = launched
            return list(touched.values())
        done = [self._inflight] if self._inflight is not None else []
        self._inflight = launched
        if launched is not None and (launched.step.read_back_now or self._num_beam_requests):
            done.append(launched)
            self._inflight = None
        self._read_back(done, touched)
        return list(touched.values())

    def _read_back(self, done: list[Launched], touched: dict[str, Request]) -> None:
        """Process the launched steps `done`, in order; the requests they advanced go into `touched`."""
        ended: set[str] = set()  # requests a sequence of which finished: the only ones that can have finished
        for d in done:
            self._process(d, touched, ended)
        for request_id in ended:
            r = touched[request_id]
            if r.is_finished:
                self._finish_request(r)

    def _process(self, launched: Launched, touched: dict[str, Request], ended: set[str]) -> None:
        """Read a launched step's tokens back and hand them to the sequences still waiting for them."""
        result = launched.step.result()
        if result.pooled is not None:
            self._process_pooled(launched.scheduled.seqs, result.pooled, touched, ended)
            return
        now = time.time()
        append, generated = self.output_processor.append, 0
        grammar_done = {}  # (structured outputs only)
        if launched.grammar:
            grammar_done = self._accept_grammar(launched, result.sampled)
        beams: dict[str, list] = {}  # beam requests: their beams' draws, to be ranked together
        for i, seq in enumerate(launched.scheduled.seqs):
            if seq.is_finished:  # aborted, or finished by a token of the step before while this one ran
                continue
            req = seq.request
            if result.prompt_logprobs[i]:
                req.prompt_logprobs += result.prompt_logprobs[i]
            tokens = result.sampled[i]
            if not tokens:
                continue
            if req.beam is not None:
                beams.setdefault(req.request_id, []).append((seq, result.logprobs[i][0]))
                continue
            seqs = [seq] if len(tokens) == 1 else [seq] + self.scheduler.fork(seq)
            for s, token, lp in zip(seqs, tokens, result.logprobs[i] or [None] * len(seqs)):
                if append(s, token, lp, grammar_done.get(s.seq_id)):
                    self._retire(s)
                    ended.add(req.request_id)
            generated += len(seqs)
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            touched[req.request_id] = req
        for request_id, reports in beams.items():
            req = reports[0][0].request
            beam_search.advance(req, reports, self.scheduler)
            generated += len(reports)
            if req.beam.done:  # its only output: the finished beams
                for seq in req.seqs:
                    self.output_processor.decode(seq)
                touched[request_id] = req
                ended.add(request_id)
        self.stats.generation_tokens += generated

    def _accept_grammar(self, launched: Launched, sampled: list[list[int]]) -> dict[int, bool]:
        """A grammar step's single draws handed to their matchers at once (structured_output.accept): seq_id ->
        whether its grammar is done. (Forks and beams take theirs one by one in `append`.)"""
        rows = [
            (seq, tokens[0])
            for seq, tokens in zip(launched.scheduled.seqs, sampled)
            if seq.grammar is not None and len(tokens) == 1 and not seq.is_finished and seq.request.beam is None
        ]
        done = self._structured.accept([seq.grammar for seq, _ in rows], [token for _, token in rows])
        return {seq.seq_id: d for (seq, _), d in zip(rows, done)}

    def _process_pooled(self, seqs: list[Sequence], pooled: list, touched: dict[str, Request], ended: set[str]) -> None:
        """A pooling step read back: each sequence whose prompt it finished has its vector and is done (its
        blocks freed; the prefix cache may keep them)."""
        now = time.time()
        for seq, vector in zip(seqs, pooled):
            if vector is None or seq.is_finished:
                continue
            req = seq.request
            req.embedding = pooling.finish(vector, req.pooling_params, self.pooler_config.normalize)
            req.metrics.first_token_time = req.metrics.last_token_time = now
            seq.finish_reason = "stop"
            seq.drop_pending()
            self._retire(seq)
            touched[req.request_id] = req
            ended.add(req.request_id)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.output_processor.release(seq)

    def _finish_request(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if req.beam is not None:
            self._num_beam_requests -= 1
        req.metrics.finished_time = time.time()
        reason = req.seqs[0].finish_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = self.scheduler.num_waiting
        s.kv_cache_usage = self.block_manager.usage
        s.num_gpu_blocks = self.block_manager.num_blocks
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        if (loras := self.scheduler.loras) is not None:
            s.running_lora_adapters, s.waiting_lora_adapters = loras.running_adapters(), loras.waiting_adapters()
        return s


def _default_sampling_config(choice: str, model_generation_config: dict) -> dict:
    """The generation config that gives requests their default sampling parameters (--generation-config)."""
    if choice == "auto":
        return model_generation_config
    if choice == "vllm":
        return {}
    return json.loads((Path(choice) / "generation_config.json").read_text())


def _eos_ids(generation_config: dict, cfg: TransformerConfig, tokenizer) -> tuple[int, ...]:
    """EOS tokens: generation_config.json's first (it may list several, as Llama 3 does), else the
    model config's, else the tokenizer's."""
    eos = generation_config.get("eos_token_id")
    if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (eos,)
    if cfg.eos_token_ids:
        return cfg.eos_token_ids
    return (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()
