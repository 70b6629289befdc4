"""Turns a scheduled batch (heron/batch.py: plain data) into tensors, runs the model, samples. Owns every
tensor: the weights, the paged KV cache (and its host-side swap space), the attention backend.

Inputs are built with numpy and copied to the device in one copy a step; the only device-to-host transfer
of a step is reading the sampled tokens (and their logprobs when asked) at the end.

Length: the one owner of a step's tensors; its parts (layout, buffers, graph keys, LoRA) are modules of their own.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from heron.attention import AttentionMetadata, get_backend_cls
from heron.batch import ScheduledBatch
from heron.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from heron.distributed import get_tp_world_size
from heron.executor.graph_keys import GraphKey, GraphKeys, is_decode
from heron.executor.inflight import Forward, InflightStep, StepInputs
from heron.executor.input_buffers import BlockTables, InputBuffers, StepArrays, pad_to_graph
from heron.executor.lora_manager import LoRAManager
from heron.executor.pooler import PooledStep, Pooler
from heron.executor.sampler import Sampler, SamplingTensors, gather_logprobs
from heron.executor.step_layout import Tokens, host_input_ids, prompt_logprob_rows, sampling_rows, token_layout
from heron.kernels.gemm.plans import MatmulPlans, use_plans
from heron.kernels.gemm.tune import tune_and_summarise
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear
from heron.layers.vocab_embedding import ParallelLMHead
from heron.models.config import TransformerConfig
from heron.models.loader import ModelSource
from heron.models.quantization import init_dummy_weights, quantize_layers, quantized_weights
from heron.models.registry import get_model_cls

if TYPE_CHECKING:
    from heron.executor.step_broadcast import StepSender

logger = logging.getLogger(__name__)
_KV_MARGIN = 512 << 20  # bytes of the driver's free memory a KV cache capped by it leaves to the rest of start-up

# On the CPU, without kv_cache_memory, the KV cache holds max_num_seqs full-length sequences up to this many
# bytes (and always one full-length sequence): a laptop should not hold gigabytes for a small model.
_CPU_KV_CAP = 512 << 20


class ModelRunner:
    def __init__(
        self, config: EngineConfig, source: ModelSource, model_cfg: TransformerConfig, device: torch.device
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # the paged cache's
        if self.kv_dtype.itemsize == 1 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(  # Triton converts float8 e4m3 from sm_89 (Ada, Hopper) on
                f"kv_cache_dtype {config.cache.kv_cache_dtype!r} needs a GPU of compute capability 8.9 or later."
            )
        if device.type == "cuda":  # Triton compiles until the warm-up's end are this start-up's
            from heron.kernels.common import compiles_expected

            compiles_expected(self)
            # What an engine built before this one in the process freed goes back to the driver first: else the
            # weights are carved out of its cached segments, and the KV cache cannot have that memory in one piece
            gc.collect()
            torch.cuda.empty_cache()
        self.model_cfg = model_cfg
        self.block_size = config.cache.block_size
        # this rank's heads: its attention and its share of the KV cache (all of them at one rank)
        self.num_heads, self.num_kv_heads = model_cfg.heads_per_rank(get_tp_world_size())
        backend_cls = get_backend_cls(config.attention_backend, device.type)
        self.backend = backend_cls(self.num_heads, self.num_kv_heads, model_cfg.head_dim, model_cfg.head_dim**-0.5)
        self.matmul_plans = MatmulPlans()  # the projections' tuned BLAS kernels (_tune_matmuls), kept by the layers
        self.model = self._load_model(source)
        sched = config.scheduler
        self.lora = LoRAManager.build(self.model, config, device)  # None without enable_lora
        if device.type == "cuda" and config.matmul_tuning:
            self._tune_matmuls()
        max_blocks = -(-sched.max_model_len // self.block_size)
        self.backend.reserve(
            sched.max_num_seqs,
            device,
            dtype=self.kv_dtype,
            block_size=self.block_size,
            max_blocks_per_seq=max_blocks,
            # (tensor-parallel workers get the block tables on the device only: nothing to plan from on the host)
            cascade_attn=not config.disable_cascade_attn and get_tp_world_size() == 1,
        )
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.cpu_kv_cache: torch.Tensor | None = None
        self.max_num_seqs = sched.max_num_seqs
        self.buffers = InputBuffers(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks, device)
        self.block_tables = BlockTables(2 * sched.max_num_seqs, max_blocks)
        self._arange = np.arange(max(sched.max_num_seqs, sched.max_num_batched_tokens) + 1)
        self._last_sampled = torch.zeros(1, dtype=torch.long, device=device)  # the previous step's token ids
        self._last_seq_ids: list[int | None] = []  # per row of _last_sampled: its sequence (None: a fork's)
        # Pinned host buffers for the sampled tokens, used in turn (a `.to("cpu")` would allocate pinned memory
        # and record an event each step).
        self._tokens_host = (
            [torch.zeros(sched.max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
            if device.type == "cuda"
            else []
        )
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # key -> (graph, hidden)
        # decode and mixed graphs captured with the cascade kernels, for steps whose decode rows share prefixes
        # (same keys)
        self.cascade_graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_keys = GraphKeys([], [])  # the captured graphs' keys (none until capture_cuda_graphs)
        self._graph_logits: torch.Tensor | None = None  # [largest decode graph, vocab] float32: their LM head
        self.step_sender: StepSender | None = None  # tensor parallelism, rank 0: hands each step to the others
        pooling = config.model.runner == "pooling"  # (the engine has resolved its pooler config)
        self.pooler = Pooler(config.model.pooler_config.pooling_type) if pooling else None

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        start = time.perf_counter()
        cls = get_model_cls(self.model_cfg.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # on `meta`: no time spent on random init of weights about to be overwritten
            # built for the context it serves: RoPE tables of max_model_len rows (LongRoPE's factors follow it)
            cfg = dataclasses.replace(self.model_cfg, max_position_embeddings=self.config.scheduler.max_model_len)
            with torch.device("meta"), use_plans(self.matmul_plans):
                model = cls(cfg, self.backend)
                quant = quantize_layers(model, source.hf_config, self.config.model.quantization)
        finally:
            torch.set_default_dtype(default_dtype)
        model.to_empty(device=self.device)
        for module in model.modules():
            if hasattr(module, "materialize"):
                module.materialize()
        with torch.no_grad():
            if self.config.model.load_format == "dummy":
                init_dummy_weights(model, self.config.model.seed)
            else:
                model.load_weights(quantized_weights(model, source.weights(), quant) if quant else source.weights())
        model.eval()
        logger.info(
            "loaded %s (%.0f M parameters, %s) in %.1f s",
            source.name,
            sum(p.numel() for p in model.parameters()) / 1e6,
            self.dtype,
            time.perf_counter() - start,
        )
        return model

    def _tune_matmuls(self) -> None:
        """The BLAS kernel for each projection at each row count a step can run as (heron/kernels/gemm/tune.py):
        the decode batch sizes past the GEMV's 16 rows, the small-step graphs' token counts and the step
        budget (a library chosen at a row count covers the counts below it down to the next one); the LM
        head's in the dtype its logits take."""
        from heron.kernels.gemv import MAX_M as GEMV_MAX_ROWS

        sched = self.config.scheduler
        keys = GraphKeys.plan(sched.max_num_seqs, sched.max_num_batched_tokens, prefill=True)
        rows = [
            m
            for m in {*keys.decode_sizes, *(k[0] for k in keys.prefill + keys.mixed), sched.max_num_batched_tokens}
            if m > GEMV_MAX_ROWS
        ]
        heads = [m for m in self.model.modules() if isinstance(m, ParallelLMHead)]
        weights = [m.weight for m in self.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        if self.lora is not None:  # a LoRA'd projection's products past one row are by its extended weight
            # (heron/layers/lora.py's `extend`): that one is tuned in its base weight's place
            extended = {id(s.base.weight): s.extended for s in self.lora.stacks.values() if s.extended is not None}
            weights = [extended.get(id(w), w) for w in weights]
        weights += [m.weight for m in heads if not m.float32_matmul()]
        float32_out = [m.weight for m in heads if m.float32_matmul()]
        logger.info(tune_and_summarise(self.matmul_plans, weights, rows, float32_out))

    # -- the KV cache ------------------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * self.kv_dtype.itemsize

    def num_blocks_for_budget(self) -> int:
        """How many blocks the KV budget holds: an explicit `kv_cache_memory`, else on CPU what
        max_num_seqs sequences of max_model_len tokens take (capped) and on GPU what
        `gpu_memory_utilization` leaves after profiling the largest step."""
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cpu":
            sched = self.config.scheduler
            per_seq = -(-sched.max_model_len // self.block_size) * self.bytes_per_block
            budget = max(per_seq, min(per_seq * sched.max_num_seqs, _CPU_KV_CAP))
        else:
            budget = self._profile_free_memory()
        return int(budget // self.bytes_per_block)

    def _profile_free_memory(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        sched = self.config.scheduler
        tokens = sched.max_num_batched_tokens
        seq_len = min(tokens, sched.max_model_len)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(len(lens) * blocks_per_seq, 0)
        d, meta = self._fill_dummy_prefill(lens, blocks_per_seq)
        with torch.inference_mode():
            hidden = self.model(d.input_ids, d.positions, meta)
            self.model.compute_logits(hidden[: sched.max_num_seqs]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak_without_kv = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.nbytes
        self.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        other_processes = total - free - reserved
        budget = total * self.config.cache.gpu_memory_utilization - peak_without_kv - other_processes
        # The KV cache is one new segment: at most what the driver has free (less a margin for what start-up
        # allocates before it). Cached bytes that empty_cache could not return (they share segments with live
        # tensors) cannot be part of it.
        if budget > free - _KV_MARGIN:
            stranded = (reserved - torch.cuda.memory_allocated(self.device)) / 2**30
            logger.warning("the KV cache gets the driver's free memory only: %.2f GiB cached is fragmented", stranded)
            budget = free - _KV_MARGIN
        logger.info(
            "profiled a %d-token step: peak %.2f GiB without the KV cache; %.2f GiB left for it",
            tokens,
            peak_without_kv / 2**30,
            budget / 2**30,
        )
        if budget <= 0:
            raise RuntimeError(
                "No GPU memory left for the KV cache: raise gpu_memory_utilization or lower max_num_batched_tokens."
            )
        return int(budget)

    def _fill_dummy_prefill(self, lens: list[int], blocks_per_seq: int) -> tuple[SimpleNamespace, AttentionMetadata]:
        """Inputs for profiling and compiling: whole sequences of `lens` tokens (1: a decode row), each in
        its own blocks. Returns the device arrays and the metadata."""
        n, num_seqs = sum(lens), len(lens)
        if self.device.type == "cuda":  # the last dummy step's copy may be queued still: its bytes must stay
            torch.cuda.synchronize(self.device)
        arrays = self.buffers.arrays(n, num_seqs)
        h = arrays.np
        h.query_start_loc[: num_seqs + 1] = np.concatenate([[0], np.cumsum(lens)])
        h.seq_lens[:num_seqs] = lens
        h.block_tables[:num_seqs, :blocks_per_seq] = np.arange(num_seqs * blocks_per_seq).reshape(num_seqs, -1)
        pos = np.concatenate([np.arange(x) for x in lens])
        seq = np.repeat(np.arange(num_seqs), lens)
        h.input_ids[:n] = 0
        h.positions[:n] = pos
        h.slot_mapping[:n] = (
            h.block_tables[seq, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        )
        self.buffers.upload(arrays)
        return arrays.dev, self.attention_metadata(arrays, max(lens), max(lens))

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        c = self.model_cfg
        shape = (c.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        # Zeroed: attention reads padded, masked-out slots too and multiplies them by a zero weight, which
        # leaves a NaN or inf of uninitialised memory standing.
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for layer, module in enumerate(self.model.layers):
            module.self_attn.kv_cache = self.kv_cache[layer]
        if num_cpu_blocks:
            self.cpu_kv_cache = torch.zeros(
                (*shape[:2], num_cpu_blocks, *shape[3:]), dtype=self.kv_dtype, pin_memory=self.device.type == "cuda"
            )

    # -- CUDA graphs -------------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """After the KV cache is allocated, before the first step (on every tensor-parallel rank alike:
        both run collectives)."""
        self.compile_kernels()
        self.capture_cuda_graphs()
        if self.device.type == "cuda":  # any compile from here on is a stall in a step: say so
            from heron.kernels.common import warn_late_compiles

            warn_late_compiles(self, logger)

    def compile_kernels(self) -> None:
        """Run every kernel variant a step can pick once, so that Triton compiles them at start-up and not
        inside the first steps that need them (a compile takes about a second): a mixed prefill + decode
        step and the LM head at batch sizes 1, 2, 4, ..., max_num_seqs (the split-KV partition count, a
        compile-time constant of the decode kernel, is a power of two chosen from the batch size; the GEMV
        has a one-row and a many-row kernel), and the sampling kernel at as many row counts (its split plan
        depends on them), with and without a logit threshold; structured outputs' token mask once (one variant
        for any row count). With cascade attention, the mixed step again with the cascade kernels, its prompt a
        block long (past the rows below which launches skip PDL, as an eager step's): the mixed graphs hold
        max_num_seqs rows, one partition count, and a larger mixed step run eagerly with fewer sequences would
        compile its own in the middle of a job. (What a captured graph's step picks compiles in
        capture_cuda_graphs' eager runs, at start-up too.)"""
        if self.device.type != "cuda":
            return
        from heron.kernels.sampling import sample_tokens
        from heron.kernels.token_bitmask import apply_token_bitmask_

        start = time.perf_counter()
        vocab = self.model_cfg.vocab_size
        sizes = [2**k for k in range(self.max_num_seqs.bit_length())] + [self.max_num_seqs]
        with torch.inference_mode():
            for size in sorted(set(sizes)):
                d, meta = self._fill_dummy_prefill([1] * (size - 1) + [self.block_size], 1)
                cascade = dataclasses.replace(meta, cascade=True)
                if self.backend.runs_cascade(cascade):
                    self.model(d.input_ids, d.positions, cascade)
                d, meta = self._fill_dummy_prefill([1] * (size - 1) + [2], 1)
                hidden = self.model(d.input_ids, d.positions, meta)
                self.model.compute_logits(hidden[:size])  # the LM head at this many rows
                logits = torch.zeros(size, vocab, device=self.device)
                temperature = torch.ones(size, device=self.device)
                seeds = torch.zeros(size, dtype=torch.int64, device=self.device)
                for thresholds in (None, temperature):
                    sample_tokens(logits, temperature, thresholds, seeds, seeds)
            mask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=self.device)
            apply_token_bitmask_(logits[:1], mask)
        torch.cuda.synchronize(self.device)
        logger.info("compiled the kernels' variants in %.1f s", time.perf_counter() - start)

    def capture_cuda_graphs(self) -> None:
        """Capture the forward pass of every step shape graph_keys.py lists: decode batches (with their LM
        head) and, where the attention backend can replay any mix of rows, small prefill and mixed steps
        (their logits rows vary in number: gathered and projected after the replay, as in an eager step). A
        step then runs padded to its graph's counts with one launch. Largest first, so that every graph fits
        in the memory pool the first ones reserved. With cascade attention the decode and mixed steps get a
        second graph each, captured with its kernels (`cascade_graphs`). The decode graphs write their logits
        into one buffer of the largest size (a step's logits are sampled before the next step replays a
        graph), so they take [largest decode batch, vocab] float32 in all."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return
        if self.pooler is not None:  # prefill only: the graphs are mostly decode's, and the pooler reads all rows
            return
        start = time.perf_counter()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        keys = GraphKeys.plan(
            self.max_num_seqs, self.config.scheduler.max_num_batched_tokens, self.backend.supports_prefill_cuda_graphs
        )
        b, steps = self.buffers, {}  # (key, cascade) -> the step's inputs
        self._graph_logits = torch.empty(
            keys.decode_sizes[-1], self.model_cfg.vocab_size, dtype=torch.float32, device=self.device
        )
        with torch.inference_mode():
            # Every graph's step runs once eagerly before any capture: kernels compile (the prefill graphs'
            # attention variants among them), and backend and GEMV workspaces reach their final size (a buffer
            # reallocated after a capture would leave a graph pointing at freed memory).
            for key in keys.all():
                arrays = b.arrays(*key[:2])
                pad_to_graph(arrays.np, 0, 0, key)
                b.upload(arrays)
                # the graph's attention grids cover chunks of up to key[2] tokens
                meta = self.attention_metadata(arrays, key[2], key[2], cuda_graph=True, cascade=False)
                steps[key, False] = (arrays.dev, meta)
                # a cascade variant for the decode and mixed graphs (the small steps' few rows rarely group)
                cascade = dataclasses.replace(meta, cascade=True)
                if key not in keys.prefill and self.backend.runs_cascade(cascade):
                    steps[key, True] = (arrays.dev, cascade)
                for variant in (False, True):
                    if (key, variant) in steps:
                        self.backend.prepare(steps[key, variant][1])
                        self._graph_forward(key, *steps[key, variant])
                torch.cuda.synchronize(self.device)  # before the host bytes of the next key are written
            pool = None
            for key, variant in steps:
                graph = torch.cuda.CUDAGraph()
                self.backend.prepare(steps[key, variant][1])
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._graph_forward(key, *steps[key, variant])
                pool = graph.pool()
                (self.cascade_graphs if variant else self.graphs)[key] = (graph, hidden)
        self.graph_keys = keys
        torch.cuda.empty_cache()
        logger.info(
            "captured %d CUDA graphs (decode batch 1..%d, prefill steps up to %s tokens, mixed steps up to %s; %d more "
            "with cascade attention) in %.1f s; they hold %.0f MiB",
            len(self.graphs),
            keys.decode_sizes[-1],
            keys.prefill[-1][0] if keys.prefill else "no",
            keys.mixed[-1][0] if keys.mixed else "none",
            len(self.cascade_graphs),
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def _graph_forward(self, key: GraphKey, d: SimpleNamespace, meta: AttentionMetadata) -> torch.Tensor:
        """What a graph runs: the model over its rows; a decode graph then the LM head of all of them into
        `_graph_logits`. Returns the hidden states."""
        hidden = self.model(d.input_ids, d.positions, meta)
        if is_decode(key):
            self.model.compute_logits(hidden, out=self._graph_logits[: key[0]])
        return hidden

    # -- one step -------------------------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> InflightStep:
        """Launch one step on the device and return at once (on a GPU); `InflightStep.result()` waits for its
        sampled tokens. An input past a sequence's `token_ids` is the previous step's sample for it, still on
        the device, and is filled there (the engine prepares step t + 1 before step t's tokens are read back)."""
        return self.sample(self.launch(self.prepare(batch)))

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """A step's inputs, built on the host (`launch` uploads them) and its attention planned: the step before
        may still have its draw to come (a structured-output step), reading the device arrays."""
        self.move_blocks(batch.swap_out, batch.swap_in, batch.block_copies)
        self.buffers.flip()
        return self._prepare(batch)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs) -> Forward:
        """The prepared step's forward pass, behind the previous step's sampling (its inputs past the host's
        tokens are that step's samples); `sample` draws from its logits. The inputs' upload is queued here, not
        when prepared: the sampling still to come of the step before reads the same device arrays."""
        self.buffers.upload(inputs.arrays)
        d = inputs.arrays.dev
        n = inputs.num_pending
        if n and inputs.pending_in_order:  # decode of the previous step's batch: row i takes its row i
            d.input_ids[:n].copy_(self._last_sampled[:n])
        elif n:
            d.input_ids.index_copy_(0, d.pending_dst[:n], self._last_sampled.index_select(0, d.pending_src[:n]))
        num_sample = len(inputs.row_specs)
        logits_rows = num_sample if inputs.first_rows else d.logits_indices
        if self.step_sender is not None:  # the other tensor-parallel ranks run this same forward pass
            self.step_sender.send(inputs.batch, inputs.arrays, inputs.graph, inputs.meta, logits_rows)
        return Forward(inputs, self.run_forward(inputs.arrays, inputs.graph, inputs.meta, logits_rows))

    @torch.inference_mode()
    def sample(self, forward: Forward, token_bitmask: torch.Tensor | None = None) -> InflightStep:
        """Draw the launched step's tokens (under structured outputs' `token_bitmask`, host int32 [rows, words]:
        uploaded here) and queue their copy to the host; the next step's inputs take them on the device."""
        inputs, logits = forward.inputs, forward.logits
        d = inputs.arrays.dev
        num_sample = len(inputs.row_specs)
        if token_bitmask is not None:
            inputs.sampling.token_bitmask = token_bitmask.to(self.device, non_blocking=True)
        out = self.sampler(logits if inputs.first_rows else logits[:num_sample], inputs.sampling)
        self._last_sampled = out.token_ids
        prompt_lp = None
        if inputs.prompt_lp_k >= 0:
            prompt_lp = gather_logprobs(logits[num_sample:].log_softmax(-1), d.prompt_lp_targets, inputs.prompt_lp_k)
        tokens_host = None
        if self._tokens_host:  # the side of two steps ago: its tokens have been read (LLMEngine.advance)
            self._tokens_host.reverse()
            tokens_host = self._tokens_host[0][:num_sample]
        return InflightStep(len(inputs.batch), inputs, out, prompt_lp, tokens_host)

    @torch.inference_mode()
    def execute_pooling(self, batch: ScheduledBatch) -> PooledStep:
        """A pooling model's step: the model over the batch's prompt tokens (eagerly), then the pooler over
        the final hidden states; no logits, no sampling. Returns at once on a GPU."""
        self.move_blocks(batch.swap_out, batch.swap_in, batch.block_copies)
        self.buffers.flip()
        inputs = self._prepare(batch)
        d = inputs.arrays.dev
        hidden = self.model(d.input_ids, d.positions, inputs.meta)
        return self.pooler(hidden, batch, inputs.arrays.np.query_start_loc[: len(batch) + 1].tolist())

    def run_forward(
        self, arrays: StepArrays, graph: GraphKey | None, meta: AttentionMetadata, logits_rows: torch.Tensor | int
    ) -> torch.Tensor:
        """The model over the uploaded inputs (replaying the captured graph `graph`, if any), then the logits
        of the rows at the indices `logits_rows`, or of the first `logits_rows` rows of a decode step (a view:
        no gather; from a graph, its own LM head's). Tensor-parallel workers run it too: its collectives (the
        LM head's all-gather among them) need every rank."""
        captured = (self.cascade_graphs if self.backend.runs_cascade(meta) else self.graphs).get(graph)
        if captured is not None:
            captured[0].replay()
            if isinstance(logits_rows, int):
                return self._graph_logits[:logits_rows]
            hidden = captured[1]
        else:
            hidden = self.model(arrays.dev.input_ids, arrays.dev.positions, meta)
        return self.model.compute_logits(hidden[:logits_rows] if isinstance(logits_rows, int) else hidden[logits_rows])

    def move_blocks(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], copies: list[tuple[int, int]]
    ) -> None:
        """A step's KV block moves, before any of its writes (tensor-parallel workers make the same ones
        in their shares of the cache): (device, host) swap-outs, (host, device) swap-ins, then (src, dst)
        copies on the device (copy-on-write). Moved as bytes: the CPU has no float8 indexing copies."""
        kv = self.kv_cache.view(torch.uint8)
        cpu = None if self.cpu_kv_cache is None else self.cpu_kv_cache.view(torch.uint8)
        if swap_out:
            src, dst = zip(*swap_out)
            cpu[:, :, list(dst)] = kv[:, :, list(src)].to("cpu")
        if swap_in:
            src, dst = zip(*swap_in)
            kv[:, :, list(dst)] = cpu[:, :, list(src)].to(self.device, non_blocking=True)
        if copies:
            src, dst = zip(*copies)
            kv[:, :, list(dst)] = kv[:, :, list(src)]

    def attention_metadata(
        self,
        arrays: StepArrays,
        max_query_len: int,
        max_seq_len: int,
        cuda_graph: bool = False,
        cascade: bool | None = None,
    ) -> AttentionMetadata:
        """The step's attention metadata over its filled arrays, planned by the backend (tensor-parallel
        workers plan their own from the lengths rank 0 sends). `cuda_graph`: a batch padded to a captured
        graph's counts (a backend that plans into fixed buffers uses the graph's); `cascade`: as
        `AttentionMetadata.cascade`."""
        d, h = arrays.dev, arrays.host
        meta = AttentionMetadata(
            num_seqs=arrays.num_seqs,
            num_tokens=arrays.num_tokens,
            query_start_loc=d.query_start_loc,
            seq_lens=d.seq_lens,
            block_tables=d.block_tables,
            slot_mapping=d.slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=h.query_start_loc,
            seq_lens_cpu=h.seq_lens,
            block_tables_cpu=h.block_tables,
            cuda_graph=cuda_graph,
            cascade=cascade,
        )
        self.backend.prepare(meta)
        return meta

    def _prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Fill the host buffers for `batch` (`launch` uploads them) and plan its attention. Vectorised over tokens;
        the per-sequence Python left is reading each sequence's new token ids and sampling constants."""
        b, num_seqs = self.buffers, len(batch)
        starts = np.array(batch.num_computed, dtype=np.int64)
        t = token_layout(batch.num_tokens, starts, self._arange)
        graph = self.graph_keys.for_step(t.total, num_seqs, t.decode, t.max_query_len)
        if self.lora is not None:
            self.lora.prepare(batch.lora_loads, batch.lora_slots, t.seq_of_token, graph[0] if graph else t.total)
        rows = sampling_rows(batch, t.seq_lens, t.qsl)
        prompt_lp = prompt_logprob_rows(batch, starts, t.seq_lens, t.qsl)
        # the logits rows are the step's first rows: a view of the hidden states (or of a graph's logits)
        first_rows = t.decode and rows.one_each and not prompt_lp.indices

        num_rows = len(rows.specs)
        num_logits = 0 if first_rows else num_rows + len(prompt_lp.indices)
        arrays = b.arrays(*(graph[:2] if graph else (t.total, num_seqs)), num_logits, len(prompt_lp.targets))
        h = arrays.np
        h.query_start_loc[: num_seqs + 1] = t.qsl
        h.seq_lens[:num_seqs] = t.seq_lens
        num_pending, in_order = self._pending_inputs(batch, h, t)
        if not in_order:  # (in order, every input is the previous step's sample: copied in on the device)
            h.input_ids[: t.total] = host_input_ids(batch.token_ids, starts.tolist(), t)
        h.positions[: t.total] = t.positions
        max_seq_len = int(t.seq_lens.max())
        self.block_tables.gather(batch.seq_ids, batch.block_tables, h.block_tables, -(-max_seq_len // self.block_size))
        block, offset = np.divmod(t.positions, self.block_size)
        slots = h.slot_mapping[: t.total]
        np.multiply(h.block_tables[t.seq_of_token, block], self.block_size, out=slots, dtype=np.int64)
        slots += offset
        if graph is not None:
            pad_to_graph(h, t.total, num_seqs, graph)
        self._last_seq_ids = rows.seq_ids
        if not first_rows:
            h.logits_indices[:num_rows] = rows.token_index
            h.logits_indices[num_rows:] = prompt_lp.indices
        h.prompt_lp_targets[:] = prompt_lp.targets
        sampling = SamplingTensors.build(
            rows.specs,
            rows.positions,
            self.model_cfg.vocab_size,
            self.device,
            (h.sampling_f32, h.sampling_i64, b.sampling_rows(num_rows, arrays)),
            tokens=batch.token_ids if rows.one_each else [batch.token_ids[i] for i in rows.seq_of_row],
        )
        # (planned for a graph's padded batch too: the graph replays kernels, a backend may re-plan their buffers)
        # a graph without a cascade variant never cascades (else its step would run eagerly)
        cascade = None if graph is None or graph in self.cascade_graphs else False
        meta = self.attention_metadata(arrays, t.max_query_len, max_seq_len, graph is not None, cascade)
        return StepInputs(
            batch=batch,
            arrays=arrays,
            graph=graph,
            meta=meta,
            seq_of_row=rows.seq_of_row,
            row_specs=rows.specs,
            num_samples=batch.num_samples,
            sampling=sampling,
            num_pending=num_pending,
            pending_in_order=in_order,
            first_rows=first_rows,
            one_row_each=rows.one_each,
            prompt_lp_k=prompt_lp.k if prompt_lp.indices else -1,
            prompt_lp_rows=prompt_lp.rows,
        )

    def _pending_inputs(self, batch: ScheduledBatch, h: SimpleNamespace, t: Tokens) -> tuple[int, bool]:
        """The input tokens sampled by the previous step and not on the host yet (a sequence's last input,
        past its `token_ids`): how many, and whether they are simply that step's rows in order (the batch
        is the previous one, decoding); otherwise their token indices and rows are written to pending_dst /
        pending_src."""
        pending = t.seq_lens > np.fromiter(map(len, batch.token_ids), np.int64, len(batch))
        n = int(np.count_nonzero(pending))
        if not n:
            return 0, False
        if t.decode and n == len(batch) and batch.seq_ids == self._last_seq_ids:
            return n, True
        pending = np.flatnonzero(pending)
        last_rows = {seq_id: r for r, seq_id in enumerate(self._last_seq_ids) if seq_id is not None}
        h.pending_dst[:n] = t.qsl[pending + 1] - 1
        h.pending_src[:n] = [last_rows[batch.seq_ids[i]] for i in pending.tolist()]
        return n, False
