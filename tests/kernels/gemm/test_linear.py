"""Which kernels a model's CUDA paths launch (the matmul door's choices, the layers' CUDA bindings), traced on the
CPU: the tensors are a subclass that says is_cuda, and each kernel's entry point is replaced by a recorder that
computes its PyTorch reference. Kernel launches themselves are tested in tests/kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from heron.attention import AttentionMetadata
from heron.attention.torch_ref import TorchAttentionBackend
from heron.kernels import activation, fused_moe, gemv, lora, reference, rmsnorm, rope
from heron.kernels.gemm import blas, int4
from heron.kernels.gemm import linear as door
from heron.kernels.lora import LoRARows
from heron.layers.lora import ACT_REFS, LoRAMapping
from heron.models.config import TransformerConfig
from heron.models.lora import add_lora
from heron.models.quantization import init_dummy_weights, quantize_layers
from heron.models.registry import get_model_cls


class _FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:
        return True


def _fake(t):
    return t.as_subclass(_FakeCuda) if isinstance(t, torch.Tensor) and not isinstance(t, _FakeCuda) else t


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t


def _w(x, weight, weight_scale=None):
    """The GEMV's weight as a matrix of x's dtype: a float8 one times its row scales."""
    return weight if weight_scale is None else (weight.float() * weight_scale).to(x.dtype)


class _RefDelta:
    """What the shrink's recorder returns in place of a LoRADelta: the delta itself, from the references.
    `calls`: the launch list `act_and_mul` (a kernel of its own) records itself in."""

    calls: list[str] = []

    def __init__(self, delta: torch.Tensor) -> None:
        self.delta = delta

    def add_to_(self, y: torch.Tensor) -> torch.Tensor:
        return y.add_(self.delta)

    def act_and_mul(self, y: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
        _RefDelta.calls.append("lora_act_and_mul")
        return _fake(ACT_REFS["gelu_tanh" if gelu_tanh else "silu"](_plain(y) + self.delta))


def _extended_delta(weights, y, n):
    """What `lora.extended_delta` returns in its place: the delta of each row's slot from the sums an extended
    product made in y's columns past n (the door's product by every slot's A rows under the base weight)."""
    y, slots = _plain(y), _plain(weights.token_slots)[: y.shape[0]]
    a, b = _plain(weights.lora_a), _plain(weights.lora_b)
    sums = y[:, n:].float().view(y.shape[0], a.shape[0], a.shape[1])  # [T, slots, P*R]
    mine = slots.clamp(min=0)
    delta = torch.einsum("tr,trn->tn", sums[torch.arange(len(mine)), mine], b[mine].float())
    return _RefDelta(_fake((delta * (slots >= 0)[:, None]).to(y.dtype)))


def _plus(y, lora):
    if isinstance(lora, LoRARows):  # the GEMV's own tiles run the shrink: its sums, no launch
        calls = _RefDelta.calls[:]
        lora = lora.shrink()
        _RefDelta.calls[:] = calls
    return y if lora is None else lora.add_to_(y)


def _gemv_rms_norm(x, residual, norm_weight, eps, weight, bias=None, weight_scale=None, lora=None, **_):
    if residual is None:
        normed, h = reference.rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, h = reference.rms_norm_ref(x, norm_weight, eps, residual)
    return _plus(F.linear(normed, _w(x, weight, weight_scale), bias), lora), h


def _lora_shrink(
    x, a, b, slots, sorted_tokens, slot_start, sizes, rank, splits=None, *, act=None, norm=None, residual=None
):
    if act:
        u = ACT_REFS[act](x)
    elif norm and residual is not None:
        u = reference.rms_norm_ref(x, *norm, residual)[0]
    else:
        u = reference.rms_norm_ref(x, *norm) if norm else x
    return _RefDelta(reference.lora_ref(u, a, b, slots))


KERNELS = {  # name -> (modules that hold it, its reference)
    "gemv": (
        (gemv, door),
        lambda x, w, b=None, out=None, weight_scale=None, lora=None, **_: _plus(
            F.linear(x, _w(x, w, weight_scale), b), lora
        ),
    ),
    "gemv_rms_norm": ((gemv, door), _gemv_rms_norm),
    "gemv_silu_mul": (
        (gemv, door),
        lambda x, w, b=None, weight_scale=None, lora=None, **_: _plus(
            reference.silu_mul_linear_ref(x, _w(x, w, weight_scale), b), lora
        ),
    ),
    "rms_norm": ((rmsnorm, door), lambda x, w, eps, out=None: reference.rms_norm_ref(x, w, eps)),
    "fused_add_rms_norm": ((rmsnorm, door), lambda x, r, w, eps, **_: reference.rms_norm_ref(x, w, eps, r)),
    "silu_and_mul": ((activation, door), lambda x, out=None: reference.silu_and_mul_ref(x)),
    "gelu_tanh_and_mul": ((activation, door), lambda x, out=None: reference.gelu_tanh_and_mul_ref(x)),
    "apply_rope_and_cache": ((rope,), reference.apply_rope_and_cache_ref),
    "blas_linear": ((door,), lambda x, w, b=None, plans=None: F.linear(x, w, b)),
    "mm_float32": ((blas,), lambda x, w, out=None, plans=None: (x @ w.T).float()),
    "topk_softmax": ((fused_moe,), reference.topk_softmax_ref),
    "fused_experts": ((fused_moe,), reference.fused_experts_ref),
    "moe_gemv": ((fused_moe,), reference.fused_moe_ref),
    "lora_shrink": ((lora,), _lora_shrink),
    "int4_linear": ((int4,), reference.int4_linear_ref),
    "fp8_linear": ((door,), reference.fp8_linear_ref),
}


@pytest.fixture
def launches(monkeypatch):
    calls: list[str] = []
    for name, (modules, ref) in KERNELS.items():

        def recorder(*args, name=name, ref=ref, **kwargs):
            calls.append(name)
            # every tensor a launch gets is one the move made (a stale one: a freed or meta pointer on a GPU)
            kinds = [type(t).__name__ for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            assert all(k == "_FakeCuda" for k in kinds), f"{name} got a tensor left off the device: {kinds}"
            out = ref(*map(_plain, args), **{k: _plain(v) for k, v in kwargs.items()})
            return tuple(map(_fake, out)) if isinstance(out, tuple) else _fake(out)

        for module in modules:
            monkeypatch.setattr(module, name, recorder)
    monkeypatch.setattr(_RefDelta, "calls", calls)
    monkeypatch.setattr(lora, "extended_delta", _extended_delta)
    return calls


def _step(model, cfg, rows: int, decode: bool, wrap=_fake):
    """`rows` sequences, one new token each (decode) or a prompt of `rows` tokens (prefill), with the same
    tokens on every call; its tensors "on CUDA" (`wrap` _plain: on the CPU)."""
    lens = [9] * rows if decode else [rows]
    q_lens = [1] * rows if decode else [rows]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, q_lens)])
    slots = torch.cat([i * 32 + torch.arange(n - q, n) for i, (n, q) in enumerate(zip(lens, q_lens))])
    meta = AttentionMetadata(
        num_seqs=len(lens),
        num_tokens=int(qsl[-1]),
        query_start_loc=wrap(qsl),
        seq_lens=wrap(seq_lens),
        block_tables=wrap(torch.arange(len(lens) * 8, dtype=torch.int32).view(len(lens), 8)),
        slot_mapping=wrap(slots),
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    tokens = torch.randint(0, cfg.vocab_size, (int(qsl[-1]),), generator=torch.Generator().manual_seed(rows))
    hidden = model(wrap(tokens), wrap(positions), meta)
    return model.compute_logits(hidden[qsl[1:].long() - 1])


def _to_fake_cuda(module: torch.nn.Module, wrap=_fake) -> None:
    """`module` "moved to CUDA" (its tensors replaced, as a move replaces them): its layers bind their CUDA ops
    (`wrap` _plain: back on the CPU, with its references)."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        module._apply(wrap)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def _on_fake_cuda(arch: str, **extra):
    """A tiny `arch` model (config fields `extra` on top) with random bf16 weights, "moved to CUDA", with KV caches;
    with a `quantization_config`, its projections quantized (random weights as `--load-format dummy` makes)."""
    hf = dict(
        architectures=[arch],
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    cfg = TransformerConfig.from_hf(hf)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a float8 weight and its float32 scales stay as made
    try:
        model = get_model_cls(cfg.architecture)(cfg, TorchAttentionBackend(4, 2, cfg.head_dim, cfg.head_dim**-0.5))
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        if quantize_layers(model, hf, None):
            init_dummy_weights(model, 0)
        else:
            for p in model.parameters():
                p.normal_(0, 0.1)
    _to_fake_cuda(model)
    for layer in model.layers:
        layer.self_attn.kv_cache = _fake(torch.zeros(2, 17 * 8, 4, 2, cfg.head_dim, dtype=torch.bfloat16))
    return model, cfg


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_a_decoder_layer_launches_the_fused_kernels_at_decode_sizes_and_the_tuned_blas_past_them(launches, arch):
    model, cfg = _on_fake_cuda(arch)
    fused = ["gemv_rms_norm", "apply_rope_and_cache", "gemv", "gemv_rms_norm", "gemv_silu_mul"]
    unfused = ["rms_norm", "blas_linear", "apply_rope_and_cache", "blas_linear", "fused_add_rms_norm", "blas_linear"]
    unfused += ["silu_and_mul", "blas_linear"]
    later = lambda steps: [("fused_add_rms_norm" if k == "rms_norm" else k) for k in steps]
    with torch.inference_mode():
        for rows, decode, layers, head in (
            (16, True, fused + fused, ["fused_add_rms_norm", "gemv"]),
            (17, True, unfused + later(unfused), ["fused_add_rms_norm", "mm_float32"]),
            (12, False, fused + fused, ["fused_add_rms_norm", "gemv"]),  # a prefill of <= 16 tokens: the GEMV too
        ):
            launches.clear()
            logits = _step(model, cfg, rows, decode)
            assert launches == layers + head, (rows, decode)
            assert logits.dtype == torch.float32 and torch.isfinite(_plain(logits)).all()


def test_a_sparse_layer_routes_and_runs_its_experts_in_the_fused_moe_kernels(launches):
    """Qwen3-MoE: layer 0 sparse (the router through the matmul door, then the decode GEMVs that route inside
    them at one token, routing and the grouped GEMMs at four), layer 1 dense (mlp_only_layers)."""
    model, cfg = _on_fake_cuda(
        "Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    attention = ["gemv_rms_norm", "apply_rope_and_cache", "gemv"]
    dense = [*attention, "gemv_rms_norm", "gemv_silu_mul"]
    with torch.inference_mode():
        for rows, experts in ((1, ["moe_gemv"]), (4, ["topk_softmax", "fused_experts"])):
            launches.clear()
            logits = _step(model, cfg, rows, decode=True)
            sparse = [*attention, "fused_add_rms_norm", "gemv", *experts]
            assert launches == sparse + dense + ["fused_add_rms_norm", "gemv"], rows
            assert logits.dtype == torch.float32 and torch.isfinite(_plain(logits)).all()


def test_geglu_never_takes_the_swiglu_prologue(launches):
    """Gemma 2's down projection at decode sizes: its activation kernel, then the plain GEMV (the GEMV's fused
    prologue computes SiLU). Its post-norms are norm kernels of their own."""
    model, cfg = _on_fake_cuda("Gemma2ForCausalLM", hidden_activation="gelu_pytorch_tanh", head_dim=16)
    layer = ["gemv_rms_norm", "apply_rope_and_cache", "gemv", "rms_norm", "gemv_rms_norm"]
    layer += ["gelu_tanh_and_mul", "gemv", "rms_norm"]
    with torch.inference_mode():
        logits = _step(model, cfg, 4, True)
    assert launches == layer + layer + ["fused_add_rms_norm", "gemv"]
    assert "gemv_silu_mul" not in launches and "silu_and_mul" not in launches
    assert torch.isfinite(_plain(logits)).all()


def test_a_lora_layer_runs_no_shrink_launch_on_a_16_bit_path(launches):
    """With adapters on every 16-bit projection no shrink launches: at one row the GEMV's own grid runs
    the shrink over the input its prologue makes (q/k/v's and gate/up's normed x + residual, down's silu(gate) *
    up) and adds the delta in its epilogue (`LoRARows`). Past one row every slot's A rows sit under the base
    weight, so the base's product (the GEMV to 16 rows, else the BLAS matmul after the norm or activation
    kernel) makes the shrink's sums too, and the expand adds the delta (gate/up's inside the activation after
    it). The logits equal the CPU path's (the base projection, then the dense reference's delta of its input),
    and the adapters change them."""
    model, cfg = _on_fake_cuda("Qwen3ForCausalLM")
    none = _fake(torch.zeros(0, dtype=torch.long))
    slots = torch.tensor([0, 1, -1, 0] * 5)  # a prefill step's 20 rows; a decode step's 4
    mapping = LoRAMapping(_fake(slots), none, none)
    add_lora(model, max_loras=2, max_rank=4, mapping=mapping)
    _to_fake_cuda(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "lora_" in name:
                buf.normal_(0, 0.3)
    decode = ["gemv_rms_norm", "apply_rope_and_cache", "gemv", "gemv_rms_norm", "gemv_silu_mul"]
    prefill = ["rms_norm", "blas_linear", "apply_rope_and_cache", "blas_linear"]
    prefill += ["fused_add_rms_norm", "blas_linear", "lora_act_and_mul", "blas_linear"]
    later = ["fused_add_rms_norm" if k == "rms_norm" else k for k in prefill]
    steps = {(1, True): decode + decode, (4, True): decode + decode, (20, False): prefill + later}

    def run(wrap) -> list[torch.Tensor]:
        out = []
        for (rows, is_decode), want in steps.items():
            for block in model.layers:
                block.self_attn.kv_cache.zero_()
            launches.clear()
            out.append(_plain(_step(model, cfg, rows, is_decode, wrap=wrap)))
            if wrap is _fake:
                assert launches == want + ["fused_add_rms_norm", "gemv"], rows
        return out

    with torch.inference_mode():
        got = run(_fake)
        _to_fake_cuda(model, _plain)
        mapping.token_slots = _plain(mapping.token_slots)
        for block in model.layers:
            block.self_attn.kv_cache = _plain(block.self_attn.kv_cache)
        want = run(_plain)
        for name, buf in model.named_buffers():
            if "lora_" in name:
                buf.zero_()
        base = run(_plain)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    assert (want[0] - base[0]).abs().max() > 0.1  # the one row's (slot 0)
    adapted = slots[:4] >= 0  # the decode rows' adapters changed their logits, and only theirs
    assert (want[1] - base[1]).abs()[adapted].amax(1).min() > 0.1 and torch.equal(want[1][~adapted], base[1][~adapted])
    assert (want[2] - base[2]).abs().max() > 0.1  # the prefill's last row (slot 0)


def test_an_int4_layer_runs_the_w4a16_kernel_after_its_norm_and_activation(launches):
    """An AWQ model at decode and prefill sizes: every projection in the door's int4 kernel (split-K or not is
    its own choice), the norm and SwiGLU's activation as kernels of their own (the GEMV's prologues read 16-bit
    weights); the bf16 LM head as before."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    model, cfg = _on_fake_cuda("Qwen3ForCausalLM", quantization_config=awq)
    assert model.layers[0].mlp.down_proj.is_int4
    layer = ["rms_norm", "int4_linear", "apply_rope_and_cache", "int4_linear", "fused_add_rms_norm", "int4_linear"]
    layer += ["silu_and_mul", "int4_linear"]
    later = ["fused_add_rms_norm" if k == "rms_norm" else k for k in layer]
    with torch.inference_mode():
        for rows, decode in ((4, True), (20, False)):  # a prefill's head: its last token's row, in the GEMV
            launches.clear()
            logits = _step(model, cfg, rows, decode)
            assert launches == layer + later + ["fused_add_rms_norm", "gemv"]
            assert torch.isfinite(_plain(logits)).all()


def test_an_fp8_layer_takes_the_fused_gemv_at_decode_sizes_and_the_fp8_gemm_past_them(launches):
    """An FP8 model (`--quantization fp8`): at decode sizes the same fused GEMV launches as a bf16 model (the
    weight read in float8, W8A16); past 16 rows the W8A8 GEMM, after the norm and activation kernels."""
    model, cfg = _on_fake_cuda("Qwen3ForCausalLM", quantization_config={"quant_method": "fp8"})
    assert model.layers[0].mlp.down_proj.is_fp8
    fused = ["gemv_rms_norm", "apply_rope_and_cache", "gemv", "gemv_rms_norm", "gemv_silu_mul"]
    unfused = ["rms_norm", "fp8_linear", "apply_rope_and_cache", "fp8_linear", "fused_add_rms_norm", "fp8_linear"]
    unfused += ["silu_and_mul", "fp8_linear"]
    later = ["fused_add_rms_norm" if k == "rms_norm" else k for k in unfused]
    with torch.inference_mode():
        for rows, layers, head in (
            (4, fused + fused, ["fused_add_rms_norm", "gemv"]),
            (17, unfused + later, ["fused_add_rms_norm", "mm_float32"]),
        ):
            launches.clear()
            logits = _step(model, cfg, rows, decode=True)
            assert launches == layers + head, rows
            assert torch.isfinite(_plain(logits)).all()
