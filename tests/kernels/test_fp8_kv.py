"""The float8 (e4m3) KV cache (`--kv-cache-dtype fp8`): the fused rotary + cache write against the reference
write, the decode, prefill and cascade kernels and both attention backends against the float32 reference on the
same float8 cache (tight: the kernels' own rounding), and against the bf16 cache it was quantized from (loose:
what float8 costs, e4m3's 3 mantissa bits). Scales other than 1.0 check that each kernel applies them once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from heron.attention.backend import AttentionParams  # noqa: E402
from heron.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from heron.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from heron.kernels.cascade import cascade_prefix_attention, make_prefix_workspace, tile_seqs  # noqa: E402
from heron.kernels.paged_decode import _paged_decode_kernel, paged_decode_attention  # noqa: E402
from heron.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from heron.kernels.reference import (  # noqa: E402
    FP8_MAX,
    apply_rope_and_cache_ref,
    dequantize_kv,
    paged_decode_ref,
    paged_prefill_ref,
    quantize_kv,
    write_kv_ref,
)
from heron.kernels.rope import apply_rope_and_cache  # noqa: E402
from tests.kernels.kernel_utils import assert_close, make_batch, pick_device, rel_err, skip_unless_runnable  # noqa: E402

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
skip_unless_runnable(_paged_decode_kernel, DEVICE)

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
K_SCALE, V_SCALE = 0.5, 2.0  # not 1.0: a scale applied twice, or not at all, fails the tight comparisons
# What float8 costs an attention output, against the bf16 cache it was quantized from (relative Frobenius error;
# measured 0.03-0.04 on these random caches, e4m3 rounding each element by up to 2**-4).
FP8_VS_BF16 = 0.06


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, gen: torch.Generator):
    """A random bf16 cache and its float8 copy (K / K_SCALE, V / V_SCALE)."""
    src = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, BF16)
    fp8 = torch.stack([quantize_kv(src[0], FP8, K_SCALE), quantize_kv(src[1], FP8, V_SCALE)])
    return src, fp8


def test_quantize_round_trip_and_clamp():
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e6, 0.01])
    q = quantize_kv(x, FP8, 2.0)
    assert q.dtype == FP8 and not torch.isnan(q.float()).any()
    back = dequantize_kv(q, torch.float32, 2.0)
    assert back[3] == 2 * FP8_MAX and back[4] == -2 * FP8_MAX  # clamped, not NaN
    inside = [0, 1, 2, 5]
    assert torch.allclose(back[inside], x[inside], rtol=2**-4, atol=2**-9 * 2.0)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_writes_fp8_as_the_reference(qk_norm):
    gen = torch.Generator().manual_seed(1)
    t, h, hkv, d, block_size, num_blocks = 5, 4, 2, 32, 4, 6
    q = torch.randn(t, h, d, generator=gen).to(DEVICE, BF16)
    k = 4 * torch.randn(t, hkv, d, generator=gen).to(DEVICE, BF16)
    k[0, 0, 0] = 5000.0  # past 448 * K_SCALE: clamped
    v = torch.randn(t, hkv, d, generator=gen).to(DEVICE, BF16)
    pos = torch.tensor([3, 0, 9, 4, 7], device=DEVICE)
    cos_sin = torch.randn(16, d, generator=gen).to(DEVICE)
    slots = torch.tensor([5, 0, -1, 23, 11], device=DEVICE)  # -1: a padded row writes nothing
    norms = (torch.rand(d, generator=gen).to(DEVICE, BF16) + 0.5,) * 2 if qk_norm else ()
    caches = [torch.zeros(2, num_blocks, block_size, hkv, d, dtype=FP8, device=DEVICE) for _ in range(2)]
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    q_ker = apply_rope_and_cache(q, k, v, pos, cos_sin, caches[0], slots, *norms, **scales)
    q_ref = apply_rope_and_cache_ref(q, k, v, pos, cos_sin, caches[1], slots, *norms, **scales)
    assert torch.equal(q_ker, q_ref)
    # The same bytes; with the q/k norm, whose bf16 rounding the kernel matches in all but a few elements, a
    # few a float8 step apart.
    got, want = caches[0].float(), caches[1].float()
    differ = got != want
    assert differ.float().mean() <= (0.01 if qk_norm else 0.0)
    assert (got - want)[differ].abs().le(want[differ].abs() * 2**-3 + 2**-9).all()
    assert not torch.isnan(got).any() and (qk_norm or got[0].abs().max() == FP8_MAX)  # (the norm tames 5000)
    assert caches[0].view(torch.uint8).view(2, -1, hkv, d)[:, [1, 2, 3]].eq(0).all()  # slots nobody wrote


DECODE = [((8, 2), 32, 16, 1, [1, 17, 50]), ((4, 4), 64, 16, 3, [33, 96, 5])]


@pytest.mark.parametrize("heads,head_dim,block_size,parts,seq_lens", DECODE)
def test_paged_decode_fp8(heads, head_dim, block_size, parts, seq_lens):
    gen = torch.Generator().manual_seed(parts)
    num_heads, num_kv_heads = heads
    meta = make_batch(seq_lens, [1] * len(seq_lens), block_size, DEVICE, gen)
    src, cache = _caches(meta.num_blocks, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE, BF16)
    args = (meta.block_tables, meta.seq_lens, head_dim**-0.5)
    block_n = None if ON_GPU else 16
    out = paged_decode_attention(
        q, cache, *args, num_partitions=parts, block_n=block_n, k_scale=K_SCALE, v_scale=V_SCALE
    )
    assert_close(out, paged_decode_ref(q.float(), cache, *args, k_scale=K_SCALE, v_scale=V_SCALE), BF16, "decode")
    assert rel_err(out, paged_decode_ref(q.float(), src.float(), *args)) < FP8_VS_BF16


def test_window_and_soft_cap_fp8():
    """Gemma's and Mistral's variants (a sliding window, capped scores) read a float8 cache through the same tiles."""
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size, window, cap = 4, 2, 32, 16, 20, 30.0
    seq_lens, q_lens = [45, 30, 9], [1, 12, 1]
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    _, cache = _caches(meta.num_blocks, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, BF16)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    kw = dict(sliding_window=window, soft_cap=cap, k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_prefill_attention(q, cache, *args, meta.max_query_len, head_dim**-0.5, block_n=16, **kw)
    assert_close(out, paged_prefill_ref(q.float(), cache, *args, head_dim**-0.5, **kw), BF16, "prefill variants")
    rows = meta.query_start_loc[:-1][torch.tensor([0, 2])]
    dec = paged_decode_attention(
        q[rows], cache, meta.block_tables[[0, 2]], meta.seq_lens[[0, 2]], head_dim**-0.5, num_partitions=2,
        block_n=None if ON_GPU else 16, **kw,
    )  # fmt: skip
    want = paged_decode_ref(
        q[rows].float(), cache, meta.block_tables[[0, 2]], meta.seq_lens[[0, 2]], head_dim**-0.5, **kw
    )
    assert_close(dec, want, BF16, "decode variants")


def test_paged_prefill_fp8():
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    seq_lens, q_lens = [20, 40, 9], [20, 13, 1]
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    src, cache = _caches(meta.num_blocks, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, BF16)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, cache, *args, meta.max_query_len, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    want = paged_prefill_ref(q.float(), cache, *args, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(out, want, BF16, "prefill")
    assert rel_err(out, paged_prefill_ref(q.float(), src.float(), *args, scale)) < FP8_VS_BF16


def test_cascade_fp8():
    from heron.attention.cascade import CascadePlanner
    from tests.kernels.test_cascade import _structure

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    tables, lens, num_blocks = _structure(np.random.default_rng(5), block_size, 2, 4, 1)
    gen = torch.Generator().manual_seed(5)
    src, cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, gen)
    b = len(lens)
    q = torch.randn(b, num_heads, head_dim, generator=gen).to(DEVICE, BF16)
    bt, sl = torch.from_numpy(tables).to(DEVICE), torch.from_numpy(lens).to(DEVICE)
    seqs = tile_seqs(num_heads, num_kv_heads, block_m=16)
    planner = CascadePlanner(b, seqs, block_size, 1, min_group=2, min_prefix_blocks=2, min_saved_bytes=1)
    groups = planner.groups(tables, lens)
    packed = np.zeros(planner.size, dtype=np.int32)
    planner.write(packed, b, groups)
    kv_start, tile_len, members = planner.views(torch.from_numpy(packed).to(DEVICE), b)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    block_n = None if ON_GPU else 16
    ws = make_prefix_workspace(b, num_heads, head_dim, DEVICE, parts=2)
    prefix = cascade_prefix_attention(q, cache, bt, tile_len, members, head_dim**-0.5, ws, block_n=block_n, **scales)
    out = paged_decode_attention(
        q, cache, bt, sl, head_dim**-0.5, num_partitions=1, block_n=block_n, kv_start=kv_start, prefix=prefix, **scales
    )
    assert len(groups) == 2
    assert_close(out, paged_decode_ref(q.float(), cache, bt, sl, head_dim**-0.5, **scales), BF16, "cascade")


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_backends_agree_on_an_fp8_cache(kind):
    """The Triton backend and the CPU's torch backend read the same float8 cache (written by the reference write,
    with the layer's scales from its AttentionParams) alike, and as the float32 oracle does."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    seq_lens, q_lens = {"decode": ([12, 40, 3], [1, 1, 1]), "mixed": ([25, 7, 40, 1], [1, 7, 11, 1])}[kind]
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    _, cache = _caches(meta.num_blocks, block_size, num_kv_heads, head_dim, gen)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, n, head_dim, generator=gen).to(DEVICE, BF16) for n in (num_heads, *[num_kv_heads] * 2))
    write_kv_ref(k, v, cache, meta.slot_mapping, K_SCALE, V_SCALE)
    params = AttentionParams(head_dim**-0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    tri = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, params.scale)
    tri.num_partitions = 2 if not ON_GPU else None
    tri.reserve(len(seq_lens), DEVICE)
    got = tri.forward(q, cache, meta, params)
    torch_out = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, params.scale).forward(q, cache, meta, params)
    want = torch.empty_like(q, dtype=torch.float32)
    starts = meta.query_start_loc_cpu.tolist()
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    for i in range(len(seq_lens)):  # each sequence's rows by the prefill oracle (a decode row is a 1-token chunk)
        rows = slice(starts[i], starts[i + 1])
        qsl = torch.tensor([0, q_lens[i]], dtype=torch.int32, device=DEVICE)
        want[rows] = paged_prefill_ref(
            q[rows].float(), cache, meta.block_tables[i : i + 1], meta.seq_lens[i : i + 1], qsl, params.scale, **scales
        )
    assert_close(got, want, BF16, f"triton {kind}")
    assert_close(torch_out, want, BF16, f"torch {kind}")
