"""Attention on our own Triton kernels (heron/kernels): paged KV write, split-KV decode, paged prefill.

Per step (prepare, from the host copies of the lengths: no device read-back) the batch is one of
  decode   every sequence has one new token: the split-KV decode kernel alone (the CUDA-graph case);
  prefill  no sequence has exactly one new token: the prefill kernel alone;
  mixed    both: the decode kernel over all B sequences, skipping on the device those whose query length
           is not 1, and the prefill kernel over a work list of the others' query tiles.
Two kernels rather than one: a decode row has a single query, so its only parallelism is over the keys
(split-KV, P partitions + a reduce), while a prefill chunk has parallelism over query tiles and wants
large M tiles. Selecting rows on the device (the decode kernel returns for a chunk's rows; the prefill
kernel's programs list the chunks' tiles from query_start_loc) needs no host-built index lists, no extra
copies and no sync, and lets a graph captured for a step's token count replay any mix of rows.

A decode step of many sequences (at most 2 partitions each) starts its programs longest sequence first
(`paged_decode.longest_first`, one argsort on the device by the step's first layer, shared by the others): the
last programs to start are then short ones, not a long sequence that keeps one SM busy after the rest finish.

Cascade (`reserve(cascade_attn=True)`, heron/attention/cascade.py): a decode or mixed step whose decode rows
share long cached prefixes in groups worth it runs the prefix kernel first (heron/kernels/cascade.py: each
group's prefix read once for all its members) and then the decode kernel over each sequence's own keys, merging
the prefix's partials (a mixed step's prompt chunks then take the prefill kernel as always). The plan is device
data at fixed addresses, so such a step replays a graph captured with both kernels (`runs_cascade`); a step
with no group runs the plain graph and pays nothing. Layers with a sliding window run the plain kernel.

A prefill or mixed step of at most PREFILL_SPLIT_TOKENS tokens gives the prefill kernel a workspace of
PREFILL_SPLITS partials (reserved once): its query tiles over long cached prefixes then share their keys
among several programs (heron/kernels/paged_prefill.py, "Split keys"). Larger steps have query tiles enough
to fill the GPU, and layers with a sliding window keep one program a tile.

A layer's sliding window and soft cap (`AttentionParams`) reach both kernels as constexprs: each distinct
set compiles a variant of its own, and a layer without them runs the kernels that full attention always ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from heron.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from heron.attention.cascade import CascadeBuffers, CascadePlanner

if TYPE_CHECKING:
    from heron.kernels.paged_prefill import SplitWorkspace

PREFILL_SPLITS = 4  # programs that may share a prefill query tile's keys
PREFILL_SPLIT_TOKENS = 1024  # the largest step whose query tiles may split (the workspace's rows)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_prefill_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # Imported here so that registering the backend never needs Triton where it is not used.
        from heron.kernels import cascade, paged_decode, paged_prefill

        self._decode = paged_decode
        self._prefill = paged_prefill
        self._cascade_kernels = cascade
        self._cascade: CascadeBuffers | None = None  # with reserve(cascade_attn=True)
        self._cascade_step = False  # the planned step runs the cascade kernels
        self.num_partitions: int | None = None  # None: paged_decode.default_num_partitions(B, Hkv)
        self._planned: tuple[AttentionMetadata, str] | None = None
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None  # split-KV partials, see reserve()
        self._order: torch.Tensor | None = None  # the planned step's launch order, see _launch_order
        self._split_ws: SplitWorkspace | None = None  # prefill partials, see reserve()

    @staticmethod
    def plan(meta: AttentionMetadata) -> str:
        """'empty', 'decode', 'prefill' or 'mixed', from host-side values only."""
        b = meta.num_seqs
        if b == 0 or meta.num_tokens == 0:
            return "empty"
        if meta.max_query_len <= 1:
            return "decode"
        if meta.cuda_graph:
            return "mixed"
        qsl = meta.query_start_loc_cpu
        has_decode = bool(((qsl[1 : b + 1] - qsl[:b]) == 1).any())
        return "mixed" if has_decode else "prefill"

    def prepare(self, meta: AttentionMetadata) -> None:
        mode = self.plan(meta)
        self._planned = (meta, mode)
        self._cascade_step = (
            self._cascade is not None
            and meta.cascade is not False
            and (mode == "mixed" or (mode == "decode" and meta.num_tokens == meta.num_seqs))
            and self._cascade.plan(meta, force=meta.cascade is True)
        )
        self._order = None  # sorted again for each step (and inside a graph captured after its eager run)

    def _mode(self, meta: AttentionMetadata) -> str:
        if self._planned is None or self._planned[0] is not meta:
            self.prepare(meta)
        return self._planned[1]

    def runs_cascade(self, meta: AttentionMetadata) -> bool:
        self._mode(meta)
        return self._cascade_step

    def reserve(
        self,
        max_num_seqs: int,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        cascade_attn: bool = False,
        **_: object,
    ) -> None:
        """Allocate the split-KV partials once, for the largest batch * partitions any step can ask for:
        a buffer reallocated later would leave captured graphs pointing at freed memory; the prefill kernel's
        split partials likewise (PREFILL_SPLIT_TOKENS rows). With `cascade_attn`
        (and the cache's dtype and block size) the cascade's plan buffers and prefix partials too."""
        if cascade_attn and dtype is not None and block_size is not None:
            kernels = self._cascade_kernels
            planner = CascadePlanner(
                max_num_seqs,
                kernels.tile_seqs(self.num_heads, self.num_kv_heads),
                block_size,
                2 * self.num_kv_heads * self.head_dim * dtype.itemsize,
            )
            self._cascade = CascadeBuffers(planner, self.num_heads, self.head_dim, kernels.PREFIX_PARTS, device)
        parts = lambda b: self.num_partitions or self._decode.default_num_partitions(b, self.num_kv_heads, device)
        need = max(b * self.num_heads * parts(b) for b in range(1, max_num_seqs + 1))
        self._ws = (
            torch.empty(need * self.head_dim, dtype=torch.float32, device=device),
            torch.empty(2 * need, dtype=torch.float32, device=device),
            torch.zeros(max_num_seqs * self.num_kv_heads, dtype=torch.int32, device=device),
        )
        self._split_ws = self._prefill.make_split_workspace(
            PREFILL_SPLITS, PREFILL_SPLIT_TOKENS, self.num_heads, self.head_dim, device
        )

    def _workspace(self, batch: int, parts: int):
        """Views of the reserved partials and arrival counters (shared by all layers: they run one after another
        on one stream, and each call leaves the counters zeroed)."""
        need = batch * self.num_heads * parts
        o, ml, counts = self._ws
        assert ml.numel() >= 2 * need, "reserve() was called with a smaller max_num_seqs than this batch"
        part_o = o[: need * self.head_dim].view(batch, self.num_heads, parts, self.head_dim)
        part_m = ml[:need].view(batch, self.num_heads, parts)
        part_l = ml[need : 2 * need].view(batch, self.num_heads, parts)
        return part_o, part_m, part_l, counts[: batch * self.num_kv_heads]

    def _launch_order(self, meta: AttentionMetadata) -> torch.Tensor:
        """The decode programs' launch order for the planned step (`forward` plans it first), computed by its first
        layer (inside a captured graph when the step is one) and reused by the others."""
        if self._order is None:
            self._order = self._decode.longest_first(meta.seq_lens[: meta.num_seqs])
        return self._order

    def _run_decode(self, q, kv_cache, meta, out, query_start_loc, params: AttentionParams, cascade=None):
        b = meta.num_seqs
        parts = self.num_partitions or self._decode.default_num_partitions(b, self.num_kv_heads, q.device)
        ws = self._workspace(b, parts) if parts > 1 else None
        kv_start, prefix = cascade or (None, None)  # (kv_start, the prefix partials) of a planned cascade
        # Ordered where each program has a long run of keys (<= 2 partitions, batches past ~64): there a long
        # sequence started last would hold the tail; small batches split every sequence 4-16 ways instead.
        order = self._launch_order(meta) if query_start_loc is None and b > 1 and parts <= 2 else None
        self._decode.paged_decode_attention(
            q,
            kv_cache,
            meta.block_tables[:b],
            meta.seq_lens[:b],
            params.scale,
            out=out,
            num_partitions=parts,
            query_start_loc=query_start_loc,
            workspace=ws,
            order=order,
            heads_first=order is not None,
            sliding_window=params.sliding_window,
            soft_cap=params.logits_soft_cap,
            kv_start=kv_start,
            prefix=prefix,
            k_scale=params.k_scale,
            v_scale=params.v_scale,
        )

    def _run_cascade(self, q, kv_cache, meta, out, query_start_loc, params: AttentionParams):
        """The planned cascade: each group's prefix once (unused tiles exit), then every decode row's own keys
        (`query_start_loc`: a mixed step's rows)."""
        b = meta.num_seqs
        kv_start, tile_len, members, partials = self._cascade.inputs(b)
        prefix = self._cascade_kernels.cascade_prefix_attention(
            q,
            kv_cache,
            meta.block_tables[:b],
            tile_len,
            members,
            params.scale,
            partials,
            soft_cap=params.logits_soft_cap,
            k_scale=params.k_scale,
            v_scale=params.v_scale,
            query_start_loc=query_start_loc,
        )
        self._run_decode(q, kv_cache, meta, out, query_start_loc, params, (kv_start, prefix))

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams | None = None
    ) -> torch.Tensor:
        params = params or self.default_params
        mode = self._mode(meta)
        # A prefill graph's rows past the step's tokens belong to no sequence: zeros, not garbage. (A decode
        # graph's padded rows are sequences without keys, which the decode kernel gives zeros: no memset.)
        out = torch.zeros_like(q) if meta.cuda_graph and mode == "mixed" else torch.empty_like(q)
        b = meta.num_seqs
        if mode == "empty":
            return out
        if mode == "decode":
            # All query lengths are 1; row i is sequence i when there are exactly B tokens.
            if self._cascade_step and not params.sliding_window:
                self._run_cascade(q, kv_cache, meta, out, None, params)
            else:
                qsl = None if meta.num_tokens == b else meta.query_start_loc
                self._run_decode(q, kv_cache, meta, out, qsl, params)
        else:
            if mode == "mixed":  # the decode rows first, as a decode step runs them
                if self._cascade_step and not params.sliding_window:
                    self._run_cascade(q, kv_cache, meta, out, meta.query_start_loc, params)
                else:
                    self._run_decode(q, kv_cache, meta, out, meta.query_start_loc, params)
            self._prefill.paged_prefill_attention(
                q,
                kv_cache,
                meta.block_tables[:b],
                meta.seq_lens[:b],
                meta.query_start_loc,
                meta.max_query_len,
                params.scale,
                out=out,
                skip_decode=mode == "mixed",
                sliding_window=params.sliding_window,
                soft_cap=params.logits_soft_cap,
                k_scale=params.k_scale,
                v_scale=params.v_scale,
                split_workspace=self._prefill_split(q, params),
            )
        return out

    def _prefill_split(self, q: torch.Tensor, params: AttentionParams) -> SplitWorkspace | None:
        """The prefill kernel's split workspace for a step small enough to use it (see the module's docstring)."""
        if self._split_ws is None or params.sliding_window or q.shape[0] > PREFILL_SPLIT_TOKENS:
            return None
        return self._split_ws
