"""The prefill kernel in a mixed step (issue 26's prefix workload): 252 decode rows beside 4 new prompts' chunks of
150 tokens, each over a 2,000-token cached prefix, Qwen3-0.6B's heads (16 / 8) and Qwen3-8B's (32 / 8), D 128,
bf16. A mixed step runs the kernel over a work list of the chunks' query tiles (skip_decode), in a grid fixed by
q's rows (896 here, a mixed graph's). Timed three ways:
  graph    as a mixed graph launches it: max_query_len = the graph's tokens, all 256 sequences;
  eager    max_query_len = the longest chunk (150), all 256 sequences (the work list ignores it: as graph);
  compact  the 4 chunks' sequences alone, in the per-sequence grid (no decode row: no work list).
Before the work list the grid had a program per (query tile row, sequence slot, KV head), ~28,000 of them as a
graph launched it, and the graph way took 130.6 us against compact's 82.1 (H100, 0.6B's heads, session 24).

    python benchmarks/mixed_prefill_probe.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from heron.attention.triton_backend import PREFILL_SPLIT_TOKENS, PREFILL_SPLITS
from heron.kernels.paged_prefill import make_split_workspace, paged_prefill_attention

DECODE_ROWS, CHUNKS, CHUNK, PREFIX, GRAPH_TOKENS, BS, D = 252, 4, 150, 2000, 896, 16, 128


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    batch = DECODE_ROWS + CHUNKS
    q_lens = torch.tensor([1] * DECODE_ROWS + [CHUNK] * CHUNKS, dtype=torch.int32)
    seq_lens = torch.tensor([PREFIX + 100] * DECODE_ROWS + [PREFIX + CHUNK] * CHUNKS, dtype=torch.int32)
    width = -(-int(seq_lens.max()) // BS)
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)  # every sequence its own blocks
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    tokens = int(qsl[-1])
    for heads, kv_heads in ((16, 8), (32, 8)):
        cache = torch.randn(2, batch * width, BS, kv_heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
        q = torch.randn(GRAPH_TOKENS, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
        ws = make_split_workspace(PREFILL_SPLITS, PREFILL_SPLIT_TOKENS, heads, D, dev)
        full = [t.to(dev) for t in (tables, seq_lens, qsl)]
        own_qsl = qsl[DECODE_ROWS:] - qsl[DECODE_ROWS]
        chunks = [t.to(dev) for t in (tables[DECODE_ROWS:], seq_lens[DECODE_ROWS:], own_qsl)]
        out_full, out_compact = torch.zeros_like(q), torch.zeros_like(q)
        q_chunks = q[int(qsl[DECODE_ROWS]) : tokens]

        def run(args, q_, out, max_q, skip):
            return lambda: paged_prefill_attention(
                q_, cache, *args, max_q, D**-0.5, out=out, skip_decode=skip, split_workspace=ws
            )

        ways = {
            "graph": run(full, q, out_full, GRAPH_TOKENS, True),
            "eager": run(full, q, out_full, CHUNK, True),
            "compact": run(chunks, q_chunks, out_compact[: len(q_chunks)], CHUNK, False),
        }
        times = {}
        for name, fn in ways.items():
            fn()
            times[name] = do_bench(fn) * 1e3
        first = int(qsl[DECODE_ROWS])  # eager's output (one program a tile) against compact's (shares merged)
        diff = (out_full[first:tokens].float() - out_compact[: tokens - first].float()).abs().max().item()
        print(
            f"heads {heads}/{kv_heads}: prefill kernel in a mixed step ({DECODE_ROWS} decode rows, {CHUNKS} chunks of "
            f"{CHUNK} over {PREFIX} cached keys): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
            + f"; max abs diff eager / compact {diff:.1e}"
        )


if __name__ == "__main__":
    main()
