"""The PyTorch reference of every Triton kernel in this package, in one place: what the CPU runs (the layers
bind these off CUDA) and the oracle the kernel tests compare against. No Triton here.

Rounding is the model's: where a kernel fuses several steps it rounds where these functions round (see each
kernel's docstring), so bf16 outputs agree bit for bit in all but a few elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """weight * rmsnorm(x) with float32 statistics (heron/kernels/rmsnorm.py). With `residual`: x + residual is
    normalised and returned too, as (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual): `rms_norm_ref` in the kernel's signature."""
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rmsnorm(x + residual)), x + residual), x the residual without one (heron/kernels/gemv.py's
    norm prologue, whose one rounding of h * weight sits within a bf16 rounding of these two)."""
    if residual is None:
        normed, residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, residual = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), residual


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I] (heron/kernels/activation.py)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> gelu_tanh(gate) * up [..., I], GELU's tanh approximation (Gemma's GeGLU;
    heron/kernels/activation.py)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul_linear_ref(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(gelu_tanh(gate) * up, weight, bias)."""
    return F.linear(gelu_tanh_and_mul_ref(gate_up), weight, bias)


def silu_mul_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) (heron/kernels/gemv.py's SwiGLU prologue)."""
    return F.linear(silu_and_mul_ref(gate_up), weight, bias)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm, then RoPE in the rotate-half layout (heron/kernels/rope.py): q [T, H, D],
    k [T, Hkv, D], cos_sin [max_pos, D] = cat(cos, sin)."""
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope_and_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`apply_rope_ref`, with the rotated k and v written into the paged cache (`write_kv_ref`, a float8 cache
    with its scales); returns q."""
    q, k = apply_rope_ref(q, k, positions, cos_sin, q_norm_weight, k_norm_weight, eps)
    write_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


FP8_MAX = 448.0  # float8 e4m3's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache's dtype: for float8, x / scale clamped to +-448 (a cast alone would give NaN past it)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached K or V in `dtype`: a float8 cache's values times its scale (computed in float32), others cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T'] (a slot of -1 or
    a row t >= T' is skipped), quantized by `quantize_kv`: the cache write of heron/kernels/rope.py's
    `apply_rope_and_cache`. (A float8 cache is written as bytes: the CPU has no float8 index_copy.)"""
    slots = slot_mapping[: k.shape[0]]
    keep = slots >= 0
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    for j, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
        x = quantize_kv(x[: slots.shape[0]][keep], kv_cache.dtype, scale)
        if is_fp8(kv_cache.dtype):
            flat[j].view(torch.uint8).index_copy_(0, slots[keep], x.view(torch.uint8))
        else:
            flat[j].index_copy_(0, slots[keep], x)


def paged_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, H, D], one query per sequence attending to its seq_lens[b] keys, the last `sliding_window` of them
    if given, scores capped at `soft_cap` (c * tanh(s / c)) if given (heron/kernels/paged_decode.py); a float8
    cache's K and V times k_scale / v_scale. Computed in float32; returns q's dtype. Reads seq_lens on the host (a
    sync): tests only."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = (
            dequantize_kv(kv_cache[j, blocks].flatten(0, 1)[:n], torch.float32, sc).repeat_interleave(group, dim=1)
            for j, sc in ((0, k_scale), (1, v_scale))
        )
        s = _capped(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, soft_cap)
        if sliding_window is not None:
            s[:, : max(0, n - sliding_window)] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


def paged_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per sequence, causal attention of its q_len new queries, at positions seq_len - q_len .. seq_len - 1,
    over its keys (heron/kernels/paged_prefill.py), each query seeing its last `sliding_window` keys only and
    its scores capped at `soft_cap` if given (a float8 cache's K and V times k_scale / v_scale), in float32;
    returns q's dtype. Reads lengths on the host: tests
    only."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        a, e = starts[b], starts[b + 1]
        if e == a:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = (
            dequantize_kv(kv_cache[j, blocks].flatten(0, 1)[:n], torch.float32, sc).repeat_interleave(group, dim=1)
            for j, sc in ((0, k_scale), (1, v_scale))
        )
        s = _capped(torch.einsum("thd,nhd->htn", q[a:e].float(), k) * scale, soft_cap)
        pos, keys = torch.arange(n - (e - a), n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
        hidden = keys > pos
        if sliding_window is not None:
            hidden |= keys <= pos - sliding_window
        s = s.masked_fill(hidden, float("-inf"))
        out[a:e] = torch.einsum("htn,nhd->thd", s.softmax(-1), v).to(q.dtype)
    return out


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]): softmax in float32, the k
    largest first, rescaled to sum to one if `renormalize` (heron/kernels/moe_routing.py's `topk_softmax`)."""
    weights, ids = logits.float().softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) [T, H] with w13 [E, 2I, H] ([gate | up] rows) and
    w2 [E, H, I] (heron/kernels/fused_moe.py's `fused_experts`, with its rounding: the SwiGLU of the rounded
    projections, the down sum times the weight rounded once, the k rows summed in float32). One matmul pair per
    expert with tokens; reads the routing on the host (the CPU's path, and the tests')."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = x.new_empty(tokens * top_k, w2.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            entries = order[start : start + n]
            act = silu_and_mul_ref(F.linear(x[entries // top_k].float(), w13[e].float()).to(x.dtype))
            down = F.linear(act.float(), w2[e].float())
            y[entries] = (down * topk_weights.reshape(-1)[entries, None].float()).to(x.dtype)
        start += n
    return y.view(tokens, top_k, -1).float().sum(1).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    """The routed experts from the router's logits (heron/kernels/fused_moe.py's `fused_moe`)."""
    return fused_experts_ref(x, w13, w2, *topk_softmax_ref(router_logits, top_k, renormalize))


def _capped(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return scores if soft_cap is None else torch.tanh(scores / soft_cap) * soft_cap


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor
) -> torch.Tensor:
    """heron/kernels/gemm/fp8.py's `fp8_linear` by dequantize-then-matmul: x quantized per token as there, both
    operands dequantized to float32, F.linear, the output in x's dtype."""
    from heron.kernels.gemm.fp8 import quantize_fp8_rows_ref

    xq, x_scale = quantize_fp8_rows_ref(x)
    y = F.linear(xq.float() * x_scale, weight.float() * weight_scale, None if bias is None else bias.float())
    return y.to(x.dtype)


def lora_ref(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Each token's adapter delta (x A[s]^T) B[s], [T, out], zero for slot -1 (heron/kernels/lora.py): two
    matmuls against every slot at once, shrink x [T, in] @ A [S*R, in]^T, each token's columns of the other
    slots zeroed, then expand @ B [S*R, out]; fixed shapes, no loop over adapters."""
    num_slots, rows, _ = lora_a.shape
    t = x.shape[0]
    shrunk = x @ lora_a.view(num_slots * rows, -1).t()
    own = (token_slots[:t, None] == torch.arange(num_slots, device=x.device)).to(x.dtype)  # one-hot, or none
    shrunk = (shrunk.view(t, num_slots, rows) * own[:, :, None]).view(t, num_slots * rows)
    return shrunk @ lora_b.view(num_slots * rows, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Heron's int4 packing: values 0..15 [..., C] -> int32 [..., C/8], element 8w + j in bits 4j..4j+3 of word w
    (the layout heron/kernels/gemm/int4.py reads; docs/quantization.md)."""
    q = q.to(torch.uint8)
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # one byte per two elements, the first in the low nibble
    return pairs.contiguous().view(torch.int32)  # four bytes a word, little-endian (every platform torch runs on)


def unpack_int4(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """`pack_int4`'s inverse, uint8 [..., 8 * W]; `order[j]`: which nibble holds element j of each word (AWQ
    interleaves them), sequential when None."""
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int32)
    if order is not None:
        shifts = shifts[torch.tensor(order, device=packed.device)]
    q = (packed.unsqueeze(-1) >> shifts) & 0xF
    return q.to(torch.uint8).reshape(*packed.shape[:-1], -1)


def dequantize_int4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [N, K] of an int4 projection: (q - zero) * scale, q and zero unsigned, each of the K / G groups of a
    row with its own scale and zero (8 where there is no zero point: the symmetric formats' offset)."""
    q = unpack_int4(weight).float()
    group = q.shape[1] // weight_scale.shape[1]
    zero = 8.0 if weight_zero_point is None else weight_zero_point.float().repeat_interleave(group, 1)
    return (q - zero) * weight_scale.float().repeat_interleave(group, 1)


def int4_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """heron/kernels/gemm/int4.py's `int4_linear` by dequantize-then-matmul in float32, the output in x's dtype."""
    w = dequantize_int4(weight, weight_scale, weight_zero_point)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """heron/kernels/token_bitmask.py's `apply_token_bitmask_`: logits [R, V] -inf, in place, where bit v % 32 of
    bitmask [>= R, W] int32 word v // 32 is 0; tokens past 32 * W are left as they are. Returns logits."""
    rows, vocab = logits.shape[0], min(logits.shape[1], 32 * bitmask.shape[1])
    bits = (bitmask[:rows, :, None] >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    logits[:, :vocab].masked_fill_(bits.reshape(rows, -1)[:, :vocab] == 0, float("-inf"))
    return logits
