"""The batched PyTorch attention (the CPU path) against the per-sequence oracle."""

import pytest
import torch

from heron.attention.torch_ref import paged_attention_batched, paged_attention_ref
from tests.kernels.kernel_utils import make_batch, make_cache, rel_err


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (16, 2, 128)])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_batched_equals_the_oracle(kind, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(hash((kind, num_heads, head_dim)) % 2**31)
    seq_lens = {"decode": [12, 40, 3, 17], "prefill": [20, 33], "mixed": [25, 7, 40, 1, 16]}[kind]
    q_lens = {"decode": [1, 1, 1, 1], "prefill": [20, 6], "mixed": [1, 7, 11, 1, 16]}[kind]
    meta = make_batch(seq_lens, q_lens, 16, torch.device("cpu"), gen)
    cache = make_cache(meta.num_blocks, 16, num_kv_heads, head_dim, torch.float32, torch.device("cpu"), gen)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen)
    ref = paged_attention_ref(q, cache, meta, head_dim**-0.5)
    assert rel_err(paged_attention_batched(q, cache, meta, head_dim**-0.5), ref) < 1e-5
    scratch = [torch.empty(0), torch.empty(0)]
    for _ in range(2):  # grown on the first call, reused on the second
        assert rel_err(paged_attention_batched(q, cache, meta, head_dim**-0.5, scratch), ref) < 1e-5


def _brute_force(q, cache, meta, scale, window, cap):
    """Each query row on its own: the keys it sees listed one by one, capped scores, a softmax."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.shape[3]
    starts = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        keys = [meta.block_tables[i, n // 16].item() * 16 + n % 16 for n in range(seq_len)]
        k, v = (cache[j].flatten(0, 1)[keys] for j in (0, 1))  # [L, Hkv, D]
        for t in range(starts[i], starts[i + 1]):
            pos = seq_len - (starts[i + 1] - t)
            seen = [n for n in range(seq_len) if n <= pos and (window is None or n > pos - window)]
            for h in range(q.shape[1]):
                s = k[seen, h // group] @ q[t, h] * scale
                s = torch.tanh(s / cap) * cap if cap else s
                out[t, h] = s.softmax(0) @ v[seen, h // group]
    return out


@pytest.mark.parametrize("window,cap", [(5, None), (None, 3.0), (17, 10.0)])
def test_window_and_soft_cap_against_brute_force(window, cap):
    gen = torch.Generator().manual_seed(7)
    meta = make_batch([25, 9, 40, 3], [1, 9, 14, 1], 16, torch.device("cpu"), gen)
    cache = make_cache(meta.num_blocks, 16, 2, 32, torch.float32, torch.device("cpu"), gen)
    q = 3 * torch.randn(meta.num_tokens, 4, 32, generator=gen)
    want = _brute_force(q, cache, meta, 0.2, window, cap)
    assert rel_err(paged_attention_ref(q, cache, meta, 0.2, window, cap), want) < 1e-5
    assert rel_err(paged_attention_batched(q, cache, meta, 0.2, sliding_window=window, soft_cap=cap), want) < 1e-5
    assert rel_err(paged_attention_ref(q, cache, meta, 0.2), want) > 1e-2  # the variant matters here
