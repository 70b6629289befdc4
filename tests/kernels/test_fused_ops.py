"""The fused elementwise kernels (RMSNorm with residual add, q/k norm + RoPE, silu_and_mul, gelu_tanh_and_mul)
against the model's
PyTorch code, which is their reference. On CPU they run under Triton's interpreter with small shapes; the
`gpu`-marked cases (production shapes, the modules' dispatch, CUDA-graph capture) run only on CUDA.

Besides a relative-error bound, bf16 outputs must equal the reference bit for bit in all but a few elements:
that catches a rounding step done differently from the PyTorch code (each one flips many elements by an ulp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from heron.kernels.activation import _act_and_mul_kernel, gelu_tanh_and_mul, silu_and_mul
from heron.kernels.reference import (
    apply_rope_ref,
    gelu_tanh_and_mul_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    write_kv_ref,
)
from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from heron.kernels.rope import apply_rope, apply_rope_and_cache
from tests.kernels.kernel_utils import pick_device, rel_err, skip_unless_runnable

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

skip_unless_runnable(_act_and_mul_kernel, DEVICE)

# dtype -> (relative Frobenius error, fraction of elements allowed to differ from the reference)
TOL = {torch.float32: (1e-5, 1.0), torch.bfloat16: (4e-3, 0.01)}
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    )
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element left unwritten?)"
    rel_tol, max_diff = TOL[ref.dtype]
    err = rel_err(out, ref)
    assert err < rel_tol, f"{what}: relative error {err:.3g} >= {rel_tol}"
    diff = (out != ref).float().mean().item()
    assert diff <= max_diff, f"{what}: {diff:.2%} of the elements differ from the reference (a rounding step?)"


def _poison(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# -- RMSNorm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(37, 64), (13, 576), (5, 1024), (2, 8192)])
def test_rms_norm(dtype, tokens, hidden):
    gen = _gen(tokens * hidden)
    # x as a row-strided view (the kernel takes the row stride), values with a non-trivial scale
    x = _randn(tokens, hidden + 8, gen=gen, dtype=dtype, scale=3.0)[:, :hidden]
    w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    out = rms_norm(x, w, EPS, out=_poison((tokens, hidden), dtype))
    _check(out, rms_norm_ref(x, w, EPS), "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(37, 64), (13, 576), (5, 1024)])
def test_fused_add_rms_norm(dtype, tokens, hidden):
    gen = _gen(7 + tokens * hidden)
    x = _randn(tokens, hidden, gen=gen, dtype=dtype)
    residual = _randn(tokens, hidden, gen=gen, dtype=dtype, scale=4.0)
    w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    x0, r0 = x.clone(), residual.clone()
    # outputs: rows of larger poisoned buffers, whose last row must stay untouched
    out_buf, res_buf = _poison((tokens + 1, hidden), dtype), _poison((tokens + 1, hidden), dtype)
    out, new_res = fused_add_rms_norm(x, residual, w, EPS, out=out_buf[:tokens], residual_out=res_buf[:tokens])
    ref_out, ref_res = rms_norm_ref(x, w, EPS, residual)
    assert torch.equal(new_res, ref_res), "new residual must be exactly x + residual rounded to the dtype"
    _check(out, ref_out, "fused_add_rms_norm")
    assert torch.isnan(out_buf[tokens]).all() and torch.isnan(res_buf[tokens]).all(), "wrote past the last row"
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs modified"
    # in place (vLLM style): the residual buffer updated, the output written over x
    out2, res2 = fused_add_rms_norm(x, residual, w, EPS, out=x, residual_out=residual)
    assert out2 is x and res2 is residual
    assert torch.equal(res2, ref_res) and torch.equal(out2, out)


def test_rms_norm_weight_dtype_promotes_like_torch():
    gen = _gen(3)
    x = _randn(9, 64, gen=gen, dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(64, generator=gen)).to(DEVICE)  # float32 weight on bf16 activations
    out = rms_norm(x, w, EPS)
    _check(out, rms_norm_ref(x, w, EPS), "rms_norm fp32 weight")


# -- q/k norm + RoPE ----------------------------------------------------------------------------------------


def _qkv_views(tokens, num_heads, num_kv_heads, head_dim, gen, dtype):
    """q, k as the model gives them: strided views of one fused qkv projection row."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype, scale=2.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)


def _cos_sin(max_pos: int, head_dim: int) -> torch.Tensor:
    from heron.layers.rotary import RotaryEmbedding

    return RotaryEmbedding(head_dim, max_pos, 1e6, None).cos_sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [(37, 6, 2, 64), (11, 4, 4, 128)])
def test_apply_rope(dtype, qk_norm, tokens, num_heads, num_kv_heads, head_dim):
    gen = _gen(tokens + head_dim + qk_norm)
    q, k = _qkv_views(tokens, num_heads, num_kv_heads, head_dim, gen, dtype)
    max_pos = 4096
    cos_sin = _cos_sin(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    norm = ()
    if qk_norm:
        norm = tuple((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype) for _ in range(2)) + (EPS,)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = apply_rope(
        q, k, positions, cos_sin, *norm, q_out=_poison(q.shape, dtype), k_out=_poison(k.shape, dtype)
    )
    q_ref, k_ref = apply_rope_ref(q, k, positions, cos_sin, *norm)
    _check(q_out, q_ref, "q")
    _check(k_out, k_ref, "k")
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [(13, 6, 2, 64), (5, 4, 4, 128)])
def test_apply_rope_and_cache(dtype, qk_norm, tokens, num_heads, num_kv_heads, head_dim):
    """The rotated k, and v, land in the paged cache at their slots (a -1 slot and the rows past a shorter
    slot_mapping write nothing; every other slot keeps its value); q as apply_rope's."""
    gen = _gen(3 * tokens + head_dim + qk_norm)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype, scale=2.0)
    q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos_sin = _cos_sin(512, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    norm = ()
    if qk_norm:
        norm = tuple((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype) for _ in range(2)) + (EPS,)
    num_blocks, block_size = 6, 4
    cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: tokens - 1]  # the last row: no slot
    slots[1] = -1
    slots = slots.to(DEVICE)
    want_cache = cache.clone()
    q_ref, k_ref = apply_rope_ref(q, k, positions, cos_sin, *norm)
    write_kv_ref(k_ref, v, want_cache, slots)
    q_out = apply_rope_and_cache(q, k, v, positions, cos_sin, cache, slots, *norm, q_out=_poison(q.shape, dtype))
    _check(q_out, q_ref, "q")
    _check(cache, want_cache, "cache")
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat, want_flat = cache.view(2, -1, num_kv_heads, head_dim), want_cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[:, untouched.to(DEVICE)], want_flat[:, untouched.to(DEVICE)]), "a slot not written changed"
    assert torch.equal(flat[1, slots[slots >= 0]], v[: tokens - 1][(slots >= 0)]), "v is copied as is"


def test_apply_rope_int32_positions_new_outputs():
    gen = _gen(5)
    q, k = _qkv_views(7, 8, 1, 64, gen, torch.bfloat16)  # MQA: one k head
    cos_sin = _cos_sin(64, 64)
    positions = torch.randint(0, 64, (7,), generator=gen, dtype=torch.int32).to(DEVICE)
    q_out, k_out = apply_rope(q, k, positions, cos_sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    q_ref, k_ref = apply_rope_ref(q, k, positions.long(), cos_sin)
    _check(q_out, q_ref, "q")
    _check(k_out, k_ref, "k")


# -- silu_and_mul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreter
@pytest.mark.parametrize("tokens,inter", [(37, 96), (3, 1100)])
def test_silu_and_mul(dtype, tokens, inter):
    gen = _gen(tokens * inter)
    x = _randn(tokens, 2 * inter, gen=gen, dtype=dtype, scale=3.0)
    x[0, :4] = torch.tensor([-200.0, 200.0, -1e4, 0.0], dtype=dtype)  # exp overflow must give -0, not NaN
    out = silu_and_mul(x, out=_poison((tokens, inter), dtype))
    _check(out, silu_and_mul_ref(x), "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    """Gemma's GeGLU: F.gelu(approximate="tanh"), rounded as PyTorch rounds it, also where tanh saturates."""
    gen = _gen(11)
    x = _randn(21, 2 * 160, gen=gen, dtype=dtype, scale=3.0)
    x[0, :5] = torch.tensor([-200.0, 200.0, -1e4, 0.0, 1e-3], dtype=dtype)
    out = gelu_tanh_and_mul(x, out=_poison((21, 160), dtype))
    _check(out, gelu_tanh_and_mul_ref(x), "gelu_tanh_and_mul")
    assert rel_err(out, silu_and_mul_ref(x)) > 0.05  # another activation than SwiGLU's


# -- GPU only: production shapes, the modules' dispatch, CUDA graphs ----------------------------------------


@gpu_only
@pytest.mark.parametrize("tokens", [1, 64, 4099])
def test_production_shapes(tokens):
    gen, dtype = _gen(tokens), torch.bfloat16
    for hidden in (1024, 4096, 8192):
        x, r = _randn(tokens, hidden, gen=gen, dtype=dtype), _randn(tokens, hidden, gen=gen, dtype=dtype)
        w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
        out, res = fused_add_rms_norm(x, r, w, EPS)
        ref_out, ref_res = rms_norm_ref(x, w, EPS, r)
        assert torch.equal(res, ref_res)
        _check(out, ref_out, f"fused_add_rms_norm {hidden}")
        _check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), f"rms_norm {hidden}")
    for heads, kv_heads, head_dim in ((16, 8, 128), (32, 8, 128), (64, 8, 128), (32, 32, 64)):
        q, k = _qkv_views(tokens, heads, kv_heads, head_dim, gen, dtype)
        cos_sin = _cos_sin(40960, head_dim)
        positions = torch.randint(0, 40960, (tokens,), generator=gen).to(DEVICE)
        norm = tuple((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype) for _ in range(2)) + (EPS,)
        for args in ((), norm):
            got, want = apply_rope(q, k, positions, cos_sin, *args), apply_rope_ref(q, k, positions, cos_sin, *args)
            _check(got[0], want[0], f"q {heads}/{kv_heads}/{head_dim}")
            _check(got[1], want[1], f"k {heads}/{kv_heads}/{head_dim}")
    for inter in (3072, 14336):
        x = _randn(tokens, 2 * inter, gen=gen, dtype=dtype, scale=3.0)
        _check(silu_and_mul(x), silu_and_mul_ref(x), f"silu_and_mul {inter}")


@gpu_only
def test_modules_dispatch_to_the_kernels_on_cuda():
    """The layers' modules on CUDA (Triton) against the same modules on CPU (PyTorch), moved there after being
    built: each picks its kernels when it is moved."""
    from heron.layers import layernorm, linear, rotary

    gen, dtype, tokens = _gen(11), torch.bfloat16, 19
    norm = layernorm.RMSNorm(1024, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(1024, generator=gen))
    norm = norm.to(dtype)
    x, r = torch.randn(tokens, 1024, generator=gen).to(dtype), torch.randn(tokens, 1024, generator=gen).to(dtype)
    cpu = norm(x, r)
    gpu = norm.to(DEVICE)(x.to(DEVICE), r.to(DEVICE))
    assert torch.equal(gpu[1].cpu(), cpu[1])
    _check(gpu[0].cpu(), cpu[0], "RMSNorm module")
    rope = rotary.RotaryEmbedding(128, 4096, 1e6, None)
    qn, kn = layernorm.RMSNorm(128, EPS).to(dtype), layernorm.RMSNorm(128, EPS).to(dtype)
    q, k = torch.randn(tokens, 16, 128, generator=gen).to(dtype), torch.randn(tokens, 8, 128, generator=gen).to(dtype)
    pos = torch.randint(0, 4096, (tokens,), generator=gen)
    cpu = rope(pos, q, k, qn, kn)
    rope, qn, kn = rope.to(DEVICE), qn.to(DEVICE), kn.to(DEVICE)
    gpu = rope(pos.to(DEVICE), q.to(DEVICE), k.to(DEVICE), qn, kn)
    _check(gpu[0].cpu(), cpu[0], "rope q")
    _check(gpu[1].cpu(), cpu[1], "rope k")
    down = linear.RowParallelLinear(3072, 256, bias=False, swiglu=True)  # 19 rows: silu_and_mul, then cuBLAS
    with torch.no_grad():
        down.weight.normal_(0, 3072**-0.5, generator=gen)
    down = down.to(dtype)
    x = torch.randn(tokens, 2 * 3072, generator=gen).to(dtype)
    want = F.linear(silu_and_mul_ref(x).float(), down.weight.float())  # the activation rounded as the kernel does
    for got in (down(x), down.to(DEVICE)(x.to(DEVICE)).cpu()):  # (a matmul: float32 sums in another order)
        assert got.dtype == dtype and rel_err(got, want) < TOL[dtype][0], "down projection with SwiGLU"


@gpu_only
def test_cuda_graph_replay():
    """Capture norm -> rope -> silu_and_mul once, change the inputs in place, replay: same as running eagerly."""
    gen, dtype, tokens, hidden, heads, kv_heads, head_dim = _gen(13), torch.bfloat16, 8, 1024, 16, 8, 128
    x, r = _randn(tokens, hidden, gen=gen, dtype=dtype), _randn(tokens, hidden, gen=gen, dtype=dtype)
    w = _randn(hidden, gen=gen, dtype=dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    qw, kw = _randn(head_dim, gen=gen, dtype=dtype), _randn(head_dim, gen=gen, dtype=dtype)
    cos_sin = _cos_sin(4096, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    gate_up = _randn(tokens, 2 * 3072, gen=gen, dtype=dtype)

    def step():
        out, res = fused_add_rms_norm(x, r, w, EPS)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = apply_rope(
            q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), positions, cos_sin, qw, kw, EPS
        )
        return out, res, q, k, silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, r, qkv, gate_up):
        t.copy_(torch.randn(t.shape, generator=gen).to(DEVICE, dtype))
    positions.copy_(torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
