"""Turns a scheduled batch into tensors, runs the model, samples. Owns every tensor: the weights, the
paged KV cache (and its host-side swap space), the attention backend.

Inputs are built with numpy and copied to the device once per array; the only device-to-host transfer
of a step is reading the sampled tokens (and their logprobs when asked) at the end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from heron.config import EngineConfig, resolve_dtype
from heron.distributed import get_tp_world_size
from heron.engine.scheduler import ScheduledBatch
from heron.executor.attention import AttentionMetadata, get_backend_cls
from heron.executor.input_buffers import InputBuffers
from heron.executor.sampler import Sampler, SamplingTensors, gather_logprobs
from heron.models.config import TransformerConfig
from heron.models.loader import ModelSource
from heron.models.registry import get_model_cls
from heron.outputs import Logprobs

if TYPE_CHECKING:
    from heron.executor.step_broadcast import StepSender

logger = logging.getLogger(__name__)

_CPU_KV_DEFAULT = 2 << 30  # bytes of KV cache on CPU when not told otherwise


@dataclass
class ModelRunnerOutput:
    sampled: list[list[int]]  # per scheduled sequence: its new tokens (n of them when it forks), or []
    logprobs: list[list[Logprobs]]  # per scheduled sequence, parallel to `sampled` (empty if not asked)
    prompt_logprobs: list[list[Logprobs]]  # per scheduled sequence: for the prompt positions done this step


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, model_cfg: TransformerConfig,
                 device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.model_cfg = model_cfg
        self.block_size = config.cache.block_size
        # this rank's heads: its attention and its share of the KV cache (all of them at one rank)
        self.num_heads, self.num_kv_heads = model_cfg.heads_per_rank(get_tp_world_size())
        backend_cls = get_backend_cls(config.attention_backend, device.type)
        self.backend = backend_cls(self.num_heads, self.num_kv_heads, model_cfg.head_dim, model_cfg.head_dim ** -0.5)
        self.model = self._load_model(source)
        self.backend.reserve(config.scheduler.max_num_seqs, device)
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.cpu_kv_cache: torch.Tensor | None = None
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.buffers = InputBuffers(sched.max_num_batched_tokens, sched.max_num_seqs,
                                    -(-sched.max_model_len // self.block_size), device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, hidden)
        self.step_sender: StepSender | None = None  # tensor parallelism, rank 0: hands each step to the others

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        start = time.perf_counter()
        cls = get_model_cls(self.model_cfg.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):  # no time spent on random init of weights about to be overwritten
                model = cls(self.model_cfg, self.backend)
        finally:
            torch.set_default_dtype(default_dtype)
        model.to_empty(device=self.device)
        for module in model.modules():
            if hasattr(module, "materialize"):
                module.materialize()
        with torch.no_grad():
            if self.config.model.load_format == "dummy":
                _init_dummy(model, self.config.model.seed)
            else:
                model.load_weights(source.weights())
        model.eval()
        logger.info("loaded %s (%.0f M parameters, %s) in %.1f s", source.name,
                    sum(p.numel() for p in model.parameters()) / 1e6, self.dtype, time.perf_counter() - start)
        return model

    # -- the KV cache ------------------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * self.dtype.itemsize

    def num_blocks_for_budget(self) -> int:
        """How many blocks the KV budget holds: an explicit `kv_cache_memory`, else on CPU a fixed
        default and on GPU what `gpu_memory_utilization` leaves after profiling the largest step."""
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cpu":
            budget = _CPU_KV_DEFAULT
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
        meta = self._fill_dummy_prefill(lens, blocks_per_seq)
        with torch.inference_mode():
            b = self.buffers
            hidden = self.model(b.input_ids_dev[:tokens], b.positions_dev[:tokens], meta)
            self.model.compute_logits(hidden[: sched.max_num_seqs]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak_without_kv = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.nbytes
        self.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        other_processes = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - peak_without_kv - other_processes
        logger.info("profiled a %d-token step: peak %.2f GiB without the KV cache; %.2f GiB left for it",
                    tokens, peak_without_kv / 2**30, budget / 2**30)
        if budget <= 0:
            raise RuntimeError("No GPU memory left for the KV cache: raise gpu_memory_utilization or lower "
                               "max_num_batched_tokens.")
        return int(budget)

    def _fill_dummy_prefill(self, lens: list[int], blocks_per_seq: int) -> AttentionMetadata:
        """Prefill-shaped inputs for profiling: sequences of `lens` tokens, each in its own blocks."""
        b, n = self.buffers, sum(lens)
        b.query_start_loc[: len(lens) + 1] = np.concatenate([[0], np.cumsum(lens)])
        b.seq_lens[: len(lens)] = lens
        b.block_tables[: len(lens), :blocks_per_seq] = np.arange(len(lens) * blocks_per_seq).reshape(len(lens), -1)
        pos = np.concatenate([np.arange(x) for x in lens])
        seq = np.repeat(np.arange(len(lens)), lens)
        b.input_ids[:n] = 0
        b.positions[:n] = pos
        b.slot_mapping[:n] = b.block_tables[seq, pos // self.block_size].astype(np.int64) * self.block_size \
            + pos % self.block_size
        b.upload(n, len(lens))
        return self._metadata(len(lens), n, max(lens), max(lens))

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        c = self.model_cfg
        shape = (c.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        # Zeroed: attention reads padded, masked-out slots too and multiplies them by a zero weight, which
        # leaves a NaN or inf of uninitialised memory standing.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for layer, module in enumerate(self.model.layers):
            module.self_attn.kv_cache = self.kv_cache[layer]
        if num_cpu_blocks:
            self.cpu_kv_cache = torch.zeros((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=self.dtype,
                                            pin_memory=self.device.type == "cuda")

    # -- CUDA graphs -------------------------------------------------------------------------------------------

    def capture_cuda_graphs(self) -> None:
        """Capture the decode step's forward pass for batch sizes 1, 2, 4, 8, 16, 24, ... up to
        max_num_seqs; a decode batch then runs padded to the next size with one launch. Largest first,
        so that every graph fits in the memory pool the first one reserved."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return
        start = time.perf_counter()
        sizes = sorted({s for s in [1, 2, 4, *range(8, self.max_num_seqs + 1, 8)] if s <= self.max_num_seqs}
                       | {self.max_num_seqs}, reverse=True)
        b, pool = self.buffers, None
        run = lambda size, meta: self.model(b.input_ids_dev[:size], b.positions_dev[:size], meta)
        metas = {}
        with torch.inference_mode():
            # Every size runs once eagerly before any capture: kernels compile, and backend workspaces
            # reach their final size (a buffer reallocated after a capture would leave a graph pointing at
            # freed memory).
            for size in sizes:
                b.pad_decode(0, size)
                b.upload(size, size)
                metas[size] = self._metadata(size, size, 1, 1)
                run(size, metas[size])
            torch.cuda.synchronize(self.device)
            for size in sizes:
                graph = torch.cuda.CUDAGraph()
                self.backend.prepare(metas[size])
                with torch.cuda.graph(graph, pool=pool):
                    hidden = run(size, metas[size])
                pool = graph.pool()
                self.graphs[size] = (graph, hidden)
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(sizes), sizes[0],
                    time.perf_counter() - start)

    # -- one step -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        self._move_blocks(batch)
        inputs = self._prepare(batch)
        forward_args = (inputs["num_tokens"], inputs["graph_size"], inputs["meta"], inputs["logits_indices"])
        if self.step_sender is not None:  # the other tensor-parallel ranks run this same forward pass
            self.step_sender.send(batch, *forward_args)
        logits = self.run_forward(*forward_args)
        num_sample = inputs["num_sample_rows"]
        out = self.sampler(logits[:num_sample], inputs["sampling"])
        prompt_lp = None
        if inputs["prompt_lp_k"] >= 0:
            prompt_lp = gather_logprobs(logits[num_sample:].log_softmax(-1), inputs["prompt_lp_targets"],
                                        inputs["prompt_lp_k"])
        return self._to_host(batch, inputs, out, prompt_lp)

    def run_forward(self, num_tokens: int, graph_size: int | None, meta: AttentionMetadata | None,
                    logits_indices: torch.Tensor) -> torch.Tensor:
        """The model over the uploaded inputs (the captured graph of `graph_size` rows, if any), then the
        logits of the rows at `logits_indices`. Tensor-parallel workers run it too: its collectives (the
        LM head's all-gather among them) need every rank."""
        graph = self.graphs.get(graph_size)
        if graph is not None:
            graph[0].replay()
            hidden = graph[1]
        else:
            b = self.buffers
            hidden = self.model(b.input_ids_dev[:num_tokens], b.positions_dev[:num_tokens], meta)
        return self.model.compute_logits(hidden[logits_indices])

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        """Swaps and copy-on-write copies, before any of this step's writes."""
        kv, cpu = self.kv_cache, self.cpu_kv_cache
        if batch.swap_out:
            src, dst = zip(*batch.swap_out)
            cpu[:, :, list(dst)] = kv[:, :, list(src)].to("cpu")
        if batch.swap_in:
            src, dst = zip(*batch.swap_in)
            kv[:, :, list(dst)] = cpu[:, :, list(src)].to(self.device, non_blocking=True)
        if batch.block_copies:
            src, dst = zip(*batch.block_copies)
            kv[:, :, list(dst)] = kv[:, :, list(src)]

    def _metadata(self, num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        b = self.buffers
        meta = AttentionMetadata(
            num_seqs=num_seqs, num_tokens=num_tokens, query_start_loc=b.query_start_loc_dev[: num_seqs + 1],
            seq_lens=b.seq_lens_dev[:num_seqs], block_tables=b.block_tables_dev[:num_seqs],
            slot_mapping=b.slot_mapping_dev[:num_tokens], max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc_cpu=b.query_start_loc_host[: num_seqs + 1], seq_lens_cpu=b.seq_lens_host[:num_seqs])
        self.backend.prepare(meta)
        return meta

    def _graph_size(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds `num_seqs` decode rows."""
        return next((size for size in sorted(self.graphs) if size >= num_seqs), None)

    def _prepare(self, batch: ScheduledBatch) -> dict:
        bs, b = self.block_size, self.buffers
        num_seqs = len(batch)
        num_tokens = np.asarray(batch.num_tokens, dtype=np.int32)
        starts = np.asarray([s.num_computed_tokens for s in batch.seqs], dtype=np.int32)
        seq_lens = starts + num_tokens
        total = int(num_tokens.sum())
        qsl = b.query_start_loc[: num_seqs + 1]
        qsl[0] = 0
        np.cumsum(num_tokens, out=qsl[1:])
        b.seq_lens[:num_seqs] = seq_lens
        b.input_ids[:total] = np.concatenate([s.token_ids[x:y] for s, x, y in zip(batch.seqs, starts, seq_lens)])
        # positions and slots, vectorised over tokens
        seq_of_token = np.repeat(np.arange(num_seqs), num_tokens)
        positions = np.arange(total) - qsl[seq_of_token] + starts[seq_of_token]
        b.positions[:total] = positions
        for i, s in enumerate(batch.seqs):
            b.block_tables[i, : len(s.block_table)] = s.block_table
        b.slot_mapping[:total] = b.block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        max_query_len = int(num_tokens.max())
        graph_size = self._graph_size(num_seqs) if max_query_len == 1 else None
        if graph_size is not None:
            b.pad_decode(num_seqs, graph_size)
        b.upload(graph_size or total, graph_size or num_seqs)
        meta = None if graph_size else self._metadata(num_seqs, total, max_query_len, int(seq_lens.max()))

        logits_indices, rows = [], []  # rows: (seq, sample index, output position)
        prompt_lp_indices, prompt_lp_targets, prompt_lp_k = [], [], -1
        for i, s in enumerate(batch.seqs):
            if seq_lens[i] == len(s.token_ids):
                width = s.num_samples
                logits_indices += [qsl[i + 1] - 1] * width
                rows += [(s, s.index + j, s.num_output_tokens) for j in range(width)]
            if s.request.needs_prompt_logprobs:
                # logits at prompt position p score prompt token p + 1
                last = min(seq_lens[i], s.num_prompt_tokens - 1)
                positions_here = range(starts[i], last)
                prompt_lp_indices += [qsl[i] + p - starts[i] for p in positions_here]
                prompt_lp_targets += s.token_ids[starts[i] + 1: last + 1]
                prompt_lp_k = max(prompt_lp_k, s.params.prompt_logprobs)
        to = lambda a, dtype: torch.tensor(a, dtype=dtype).to(self.device, non_blocking=True)
        return {
            "num_tokens": total,
            "graph_size": graph_size,
            "meta": meta,
            "logits_indices": to(logits_indices + prompt_lp_indices, torch.long),
            "num_sample_rows": len(rows),
            "rows": rows,
            "sampling": SamplingTensors.build(rows, self.model_cfg.vocab_size, self.device),
            "prompt_lp_k": prompt_lp_k if prompt_lp_indices else -1,
            "prompt_lp_targets": to(prompt_lp_targets, torch.long),
        }

    def _to_host(self, batch: ScheduledBatch, inputs: dict, out, prompt_lp) -> ModelRunnerOutput:
        token_ids = out.token_ids.tolist()  # the step's one sync
        lp_ids = out.logprob_token_ids.tolist() if out.logprob_token_ids is not None else None
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        sampled: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Logprobs]] = [[] for _ in batch.seqs]
        index = {s.seq_id: i for i, s in enumerate(batch.seqs)}
        for r, (s, _, _) in enumerate(inputs["rows"]):
            i = index[s.seq_id]
            sampled[i].append(token_ids[r])
            if lps is not None and s.params.logprobs is not None:
                k = 1 + s.params.logprobs
                logprobs[i].append(dict(zip(lp_ids[r][:k], lps[r][:k])))
        prompt_logprobs: list[list[Logprobs]] = [[] for _ in batch.seqs]
        if prompt_lp is not None:
            ids, vals = prompt_lp[0].tolist(), prompt_lp[1].tolist()
            r = 0
            for i, s in enumerate(batch.seqs):
                if s.request.needs_prompt_logprobs:
                    start = int(s.num_computed_tokens)
                    count = max(min(start + batch.num_tokens[i], s.num_prompt_tokens - 1) - start, 0)
                    k = 1 + s.params.prompt_logprobs
                    prompt_logprobs[i] = [dict(zip(ids[r + j][:k], vals[r + j][:k])) for j in range(count)]
                    r += count
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights in the real shapes, for benchmarks: small normal matrices, unit norms, zero biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()
