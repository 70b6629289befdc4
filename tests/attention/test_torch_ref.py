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
