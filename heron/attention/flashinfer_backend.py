"""Attention on FlashInfer (flashinfer-python 0.6.18, `pip install 'heron[flashinfer]'`): the reference point
our Triton kernels are measured against, and a second GPU backend. `flashinfer` is imported only when this
backend is built, so Heron never needs it installed.

Each step, prepare() turns the host copies of the lengths and block tables into FlashInfer's page-table form
(`page_table`: indptr / indices / last_page_len) and plans one wrapper:
  decode   every sequence has one new token: BatchDecodeWithPagedKVCacheWrapper. A batch padded to a
           captured CUDA graph's size (meta.cuda_graph) uses a wrapper of exactly that batch size, built with
           use_cuda_graph=True over fixed device buffers and re-planned before every replay (FlashInfer fixes
           a graph wrapper's batch size); other decode batches use one eager wrapper.
  prefill  everything else, mixed batches included (a decode row is a one-token chunk):
           BatchPrefillWithPagedKVCacheWrapper, causal, with each chunk's queries at the end of its keys.
Nothing is read back from the device: plan() gets host tensors for the lengths and indptr, and the page
indices as a device copy (given host indices, FlashInfer's CUDA-graph plan copies them synchronously).

K/V are in the cache before forward (the model's rotary kernel writes them at the runner's slot_mapping,
skipping padded rows), where FlashInfer's append_paged_kv_cache would need per-token batch indices and
positions built and uploaded every step. The cache [2, num_blocks, block_size, Hkv, D] goes to FlashInfer as
the tuple of its K and V halves, each [num_blocks, block_size, Hkv, D]: the "NHD" layout.

One plan serves every layer of a step, so every layer must attend alike: a layer whose `AttentionParams` differ
from the backend's (a sliding window, soft-capped logits, another query scale: Mistral, Phi-3, Gemma) gets a
clear error, not attention it did not ask for. FlashInfer's plan() takes a window and a cap; planning one wrapper
per distinct set, CUDA-graph wrappers included, is not done.

FlashInfer JIT-compiles each kernel variant (dtype, head dim, decode / prefill) with nvcc on first use, which
takes minutes: benchmarks/flashinfer_cache.sh keeps the built modules between device runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from heron.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams

WORKSPACE_BYTES = 128 << 20  # float workspace (split-KV partials), FlashInfer's recommended size
INT_WORKSPACE_BYTES = 8 << 20  # the size each wrapper allocates for its schedule
SCRATCH_BLOCK = 0  # the page a padded row (seq_len 0) reads: any valid block, never written, output unused


def page_table(
    block_tables: np.ndarray | torch.Tensor,
    seq_lens: np.ndarray | torch.Tensor,
    block_size: int,
    indptr: np.ndarray,
    indices: np.ndarray,
    last_page_len: np.ndarray,
) -> int:
    """Write B sequences' pages in FlashInfer's form into the given int32 host arrays and return how many
    indices were written. Sequence i owns indices[indptr[i]:indptr[i+1]], the first ceil(len / block_size)
    entries of its block-table row; its last page holds last_page_len[i] tokens. A row of length 0 (a padded
    graph row) gets one page, SCRATCH_BLOCK, holding one token: FlashInfer wants 1 <= last_page_len <=
    block_size and a fixed-size batch, and that row's output is never used."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    b = len(lens)
    indptr[0] = 0
    if b == 0:
        return 0
    pages = np.maximum(-(-lens // block_size), 1)
    np.cumsum(pages, out=indptr[1 : b + 1])
    empty = lens == 0
    last_page_len[:b] = np.where(empty, 1, lens - (pages - 1) * block_size)
    n = int(indptr[b])
    table = np.asarray(block_tables)[:b, : int(pages.max())]
    indices[:n] = table[np.arange(table.shape[1]) < pages[:, None]]
    indices[indptr[:b][empty]] = SCRATCH_BLOCK
    return n


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(
                "attention_backend 'flashinfer' needs flashinfer-python: pip install 'heron[flashinfer]'"
            ) from e
        self._fi = flashinfer
        # Decode on tensor cores (FlashInfer's prefill kernels, one query row) pays once a KV head serves
        # several query heads; `python -m heron.bench.kernels --vs-flashinfer` times both kinds.
        self.use_tensor_cores = num_heads // num_kv_heads >= 4
        self._planned: tuple[AttentionMetadata, Any] | None = None
        self._graph_decode: dict[int, Any] = {}  # batch size -> its CUDA-graph decode wrapper

    def reserve(
        self,
        max_num_seqs: int,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        max_blocks_per_seq: int | None = None,
        **_: object,
    ) -> None:
        """Workspaces, the host staging of the page tables, and the fixed device buffers that the CUDA-graph
        decode wrappers read (sized for max_num_seqs full-length sequences)."""
        if dtype is None or block_size is None or max_blocks_per_seq is None:
            raise ValueError(
                "the flashinfer backend plans each step before its forward pass: reserve() needs "
                "dtype, block_size and max_blocks_per_seq"
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend runs float16 or bfloat16, not {dtype}")
        self.dtype, self.block_size = dtype, block_size
        max_pages = max_num_seqs * max_blocks_per_seq
        pinned = device.type == "cuda"
        host = lambda n: torch.zeros(n, dtype=torch.int32, pin_memory=pinned)  # noqa: E731
        dev = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        self._indptr, self._last, self._indices = host(max_num_seqs + 1), host(max_num_seqs), host(max_pages)
        self._indices_dev = dev(max_pages)
        self._graph_bufs = dev(max_num_seqs + 1), dev(max_num_seqs), dev(max_pages)  # indptr, last, indices
        # Host memory that a queued copy still reads must not be rewritten: our staging, and the pinned schedule
        # that each FlashInfer plan writes and copies to the device. So a plan first waits for the previous
        # plan's copies, which the stream runs right after the step before that: the device stays busy.
        self._copied = torch.cuda.Event() if pinned else None
        self._float_ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._int_ws = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = self._shared(self._fi.BatchPrefillWithPagedKVCacheWrapper(self._float_ws, "NHD"))
        self._decode = self._shared(
            self._fi.BatchDecodeWithPagedKVCacheWrapper(self._float_ws, "NHD", use_tensor_cores=self.use_tensor_cores)
        )

    def _shared(self, wrapper: Any) -> Any:
        """Point a wrapper at the shared workspaces. Every wrapper is planned right before it runs, one at a
        time on one stream, so one schedule buffer serves them all (a graph per batch size would otherwise
        hold dozens of 8 MB buffers)."""
        wrapper.reset_workspace_buffer(self._float_ws, self._int_ws)
        return wrapper

    def _graph_wrapper(self, batch: int) -> Any:
        """The CUDA-graph decode wrapper of one batch size, made on its first (eager, pre-capture) step."""
        if batch not in self._graph_decode:
            indptr, last, indices = self._graph_bufs
            self._graph_decode[batch] = self._shared(
                self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._float_ws,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=self.use_tensor_cores,
                    paged_kv_indptr_buffer=indptr[: batch + 1],
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:batch],
                )
            )
        return self._graph_decode[batch]

    def prepare(self, meta: AttentionMetadata) -> None:
        self._planned = (meta, self._plan(meta))

    def _plan(self, meta: AttentionMetadata) -> Any:
        """Plan the step's wrapper from host values only; None for an empty step."""
        b = meta.num_seqs
        if b == 0 or meta.num_tokens == 0:
            return None
        if meta.block_tables_cpu is None:
            raise ValueError("the flashinfer backend needs meta.block_tables_cpu (the host block tables)")
        if self._copied is not None:
            self._copied.synchronize()
        n = page_table(
            meta.block_tables_cpu,
            meta.seq_lens_cpu[:b],
            self.block_size,
            self._indptr.numpy(),
            self._indices.numpy(),
            self._last.numpy(),
        )
        indices = self._indices_dev[:n]
        indices.copy_(self._indices[:n], non_blocking=True)
        args = (
            self._indptr[: b + 1],
            indices,
            self._last[:b],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )
        kwargs = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if meta.max_query_len <= 1:
            wrapper = self._graph_wrapper(b) if meta.cuda_graph else self._decode
            wrapper.plan(*args, **kwargs)
        else:
            wrapper = self._prefill
            wrapper.plan(meta.query_start_loc_cpu[: b + 1], *args, causal=True, **kwargs)
        if self._copied is not None:
            self._copied.record()
        return wrapper

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams | None = None
    ) -> torch.Tensor:
        if params is not None and params != self.default_params:
            raise ValueError(
                f"attention_backend 'flashinfer' runs full causal attention with scale {self.scale:.6g}; this model "
                f"has a layer with {params} (a sliding window, soft-capped logits or another query scale): "
                "use attention_backend 'triton' (the default on a GPU)."
            )
        if self._planned is None or self._planned[0] is not meta:
            self.prepare(meta)
        wrapper = self._planned[1]
        if wrapper is None:
            return torch.empty_like(q)
        return wrapper.run(q, (kv_cache[0], kv_cache[1]), out=torch.empty_like(q))  # its default out is zeroed
