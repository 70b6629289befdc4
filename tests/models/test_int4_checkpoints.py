"""Int4 weight-only checkpoints (AWQ, GPTQ v1 / v2, compressed-tensors pack-quantized; heron/models/int4_formats.py)
on the tiny Llama, on the CPU (the reference path, float32): the weights Heron holds dequantize exactly to the
checkpoint's, and the model's logits and greedy tokens match transformers running those dequantized weights.

Checkpoints are written here: AWQ and GPTQ by their specs re-implemented below (AWQ's packing also checked against
compressed-tensors' AutoAWQ converter), compressed-tensors by its own compressor, whose decompression is then
the reference. Every projection is quantized in groups of 32 inputs except where the format's ignore list keeps
one in 16 bits (the AWQ checkpoint's `modules_to_not_convert: ["o_proj"]`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from heron import LLM, SamplingParams
from heron.kernels.reference import dequantize_int4
from tests.models.test_quantization import _heron_logits

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of an AWQ word holds column AWQ_ORDER[j] of its 8
PROMPT = "The capital of France is a city that"
# Heron and transformers run the same float32 weights: only summation order differs
LOGITS_REL_ERR = 1e-4
# (measured 3e-7 to 5e-7). What int4 itself costs on this random model (weights std 0.1, so wider than a trained
# model's), against the fp32 checkpoint: measured 0.30-0.35 with zero points, 0.51 symmetric (an unrelated model
# is ~1.4)
INT4_VS_FP32_REL_ERR = 0.7


def _pack(v: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [R, C] -> int32 [R, C/8], element 8w + j in bits 4j of word w (the formats' word)."""
    v = v.to(torch.int64)
    words = sum(v[:, j::8] << (4 * j) for j in range(8))
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def _quantize(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], zero uint8 [N, K/G], scale float16 [N, K/G]) by groups of GROUP inputs: min-max with a
    zero point, or absmax with the zero at 8."""
    g = w.view(w.shape[0], -1, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).half()
        zero = torch.full_like(scale, 8, dtype=torch.uint8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).to(torch.uint8)
    q = (g / scale.float()[..., None]).round() + zero[..., None]
    return q.clamp(0, 15).to(torch.uint8).view(w.shape), zero, scale


def _dense(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    groups = lambda t: t.float().repeat_interleave(GROUP, 1)  # noqa: E731
    return (q.float() - groups(zero)) * groups(scale)


def _awq_tensors(q, zero, scale) -> dict[str, torch.Tensor]:
    interleave = lambda t: t.view(t.shape[0], -1, 8)[..., AWQ_ORDER].reshape(t.shape)  # noqa: E731
    return {
        "qweight": _pack(interleave(q.t().contiguous())),  # [K, N/8]
        "qzeros": _pack(interleave(zero.t().contiguous())),  # [K/G, N/8]
        "scales": scale.t().contiguous(),  # [K/G, N]
    }


def _gptq_tensors(q, zero, scale, v1: bool) -> dict[str, torch.Tensor]:
    stored = (zero.to(torch.int64) - 1) & 0xF if v1 else zero
    return {
        "qweight": _pack(q).t().contiguous(),  # [K/8, N]: packed along K
        "qzeros": _pack(stored.t().contiguous()),  # [K/G, N/8]
        "scales": scale.t().contiguous(),
        "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // GROUP,
    }


def _copy_base(src: str, dst: Path, quantization_config: dict | None) -> None:
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg))


def _write_spec_checkpoint(base: str, path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """An AWQ ("awq") or GPTQ ("gptq" v1 asymmetric, "gptq_v2" symmetric) checkpoint; returns the dense weights."""
    symmetric = fmt == "gptq_v2"
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": symmetric}
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        qc["modules_to_not_convert"] = ["o_proj"]
    else:
        qc["checkpoint_format"] = fmt
    _copy_base(base, path, qc)
    tensors, dense = {}, {}
    for name, w in load_file(Path(base) / "model.safetensors").items():
        if not name.endswith("proj.weight") or (fmt == "awq" and "o_proj" in name):
            tensors[name] = dense[name] = w
            continue
        q, zero, scale = _quantize(w, symmetric)
        dense[name] = _dense(q, zero, scale)
        module = name.removesuffix(".weight")
        made = _awq_tensors(q, zero, scale) if fmt == "awq" else _gptq_tensors(q, zero, scale, fmt == "gptq")
        tensors.update({f"{module}.{k}": v for k, v in made.items()})
    save_file(tensors, path / "model.safetensors")
    return dense


def _write_compressed_tensors(base: str, path: Path, symmetric: bool) -> dict[str, torch.Tensor]:
    """By compressed-tensors' own compressor (W4A16 groups of 32); the dense weights by its decompression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            g = module.weight.detach().view(module.weight.shape[0], -1, GROUP)
            scale, zp = calculate_qparams(g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0), args)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _copy_base(base, path, None)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    compressor.update_config(str(path))
    sd = load_file(path / "model.safetensors")  # the reference: compressed-tensors' decompression of it
    out = {}
    for name, t in sd.items():
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            shape = torch.Size(sd[f"{module}.weight_shape"].tolist())
            zp = sd.get(f"{module}.weight_zero_point")
            if zp is not None:
                zp = unpack_from_int32(zp, 4, torch.Size([shape[0], shape[1] // GROUP]), packed_dim=0)
            q = unpack_from_int32(t, 4, shape)
            out[f"{module}.weight"] = dequantize(q, sd[f"{module}.weight_scale"], zp, args=args, dtype=torch.float32)
        elif not name.endswith(("weight_scale", "weight_zero_point", "weight_shape")):
            out[name] = t
    return out


FORMATS = ["awq", "gptq", "gptq_v2", "ct-sym", "ct-asym"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """{format: (folder, dense weights by checkpoint name)} and "base": the fp32 folder."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("int4")
    out = {"base": (base, None)}
    for fmt in FORMATS:
        if fmt.startswith("ct"):
            out[fmt] = (str(root / fmt), _write_compressed_tensors(base, root / fmt, fmt == "ct-sym"))
        else:
            out[fmt] = (str(root / fmt), _write_spec_checkpoint(base, root / fmt, fmt))
    return out


def test_awq_packing_matches_compressed_tensors_converter():
    """The AWQ spec re-implemented here agrees with compressed-tensors' AutoAWQ converter (an independent oracle
    of AWQ's interleaved order and layout)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    torch.manual_seed(0)
    q, zero, scale = _quantize(torch.randn(16, 64), symmetric=False)
    t = _awq_tensors(q, zero, scale)
    signed_q, scales, signed_zero = AutoAWQConverter(group_size=GROUP)._convert_gemm_module(
        t["qweight"], t["scales"], t["qzeros"]
    )
    assert torch.equal(signed_q.to(torch.int64) + 8, q.to(torch.int64))
    assert torch.equal(signed_zero.to(torch.int64) + 8, zero.to(torch.int64))
    assert torch.equal(scales, scale)


def _layer_weight(proj) -> torch.Tensor:
    if proj.is_int4:
        return dequantize_int4(proj.weight, proj.weight_scale, proj.weight_zero_point)
    return proj.weight


@pytest.mark.parametrize("fmt", FORMATS)
def test_int4_checkpoint_loads_exactly_and_matches_dequantized_model(fmt, checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    path, dense = checkpoints[fmt]
    llm = LLM(path, kv_cache_memory=16 << 20, max_model_len=256, device="cpu")
    model = llm.engine.runner.model
    # the fused q | k | v and gate | up rows and a row-parallel down projection dequantize to the checkpoint's
    attn, mlp = model.layers[1].self_attn, model.layers[0].mlp
    qkv = _layer_weight(attn.qkv_proj)
    fused = [dense[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    torch.testing.assert_close(qkv, torch.cat(fused), rtol=0, atol=0)
    gate_up = torch.cat([dense[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(_layer_weight(mlp.gate_up_proj), gate_up, rtol=0, atol=0)
    torch.testing.assert_close(
        _layer_weight(mlp.down_proj), dense["model.layers.0.mlp.down_proj.weight"], rtol=0, atol=0
    )
    assert attn.qkv_proj.is_int4 and (attn.o_proj.is_int4 != (fmt == "awq"))  # AWQ's ignore list kept o_proj
    assert (attn.qkv_proj.weight_zero_point is None) == (fmt == "ct-sym")

    cfg = LlamaConfig.from_pretrained(path)
    cfg.quantization_config = None
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.load_state_dict({k: v for k, v in dense.items()}, strict=False)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
    ours = _heron_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ours - ref).norm() / ref.norm() < LOGITS_REL_ERR
    # greedy decoding: the same 8 tokens as transformers on the dequantized weights
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids) :]
    assert out[0].outputs[0].token_ids == hf_ids.tolist()
    fp32 = AutoModelForCausalLM.from_pretrained(checkpoints["base"][0], dtype=torch.float32).eval()
    with torch.no_grad():
        full = fp32(torch.tensor([ids])).logits[0, -1]
    assert (ours - full).norm() / full.norm() < INT4_VS_FP32_REL_ERR


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False}, "GPTQ bits 8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version"),
        ({"quant_method": "awq", "bits": 3}, "AWQ bits 3"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "actorder": "group"}}
                },
            },
            "group 'g'",
        ),
    ],
)
def test_unsupported_int4_schemes_are_refused_by_name(qc, match):
    from heron.models.quantization import quantization_config

    with pytest.raises(ValueError, match=match):
        quantization_config({"quantization_config": qc}, None)


def test_quantization_flag_must_match_the_checkpoint(checkpoints, tiny_model_dir):
    from heron.models.quantization import quantization_config

    qc = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}}
    assert quantization_config(qc, "awq").method == "awq"
    for requested in ("gptq", "fp8"):
        with pytest.raises(ValueError, match="does not match the checkpoint's quantization_config.quant_method 'awq'"):
            quantization_config(qc, requested)
    with pytest.raises(ValueError, match="no quantization_config"):
        quantization_config({}, "gptq")
    with pytest.raises(ValueError, match="does not match"):
        LLM(checkpoints["gptq"][0], kv_cache_memory=16 << 20, max_model_len=256, device="cpu", quantization="awq")


def test_gptq_act_order_g_idx_is_refused(checkpoints, tmp_path):
    path = tmp_path / "act-order"
    shutil.copytree(checkpoints["gptq"][0], path)
    sd = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.g_idx"
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.g_idx.*act-order"):
        LLM(str(path), kv_cache_memory=16 << 20, max_model_len=256, device="cpu")


def _int4_tensors(n: int, k: int, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A full (unsplit) int4 matrix in Heron's layout, random; `group` -1: one scale per row."""
    groups = 1 if group == -1 else k // group
    return {
        "weight": torch.randint(-(2**31), 2**31, (n, k // 8), generator=gen).to(torch.int32),
        "weight_scale": torch.rand(n, groups, generator=gen) * 0.01,
        "weight_zero_point": torch.randint(0, 16, (n, groups), generator=gen).to(torch.uint8),
    }


@pytest.mark.parametrize("group", [32, -1])
def test_tensor_parallel_ranks_hold_their_rows_and_whole_groups(group, monkeypatch):
    """Each of two ranks loads its share of a fused q | k | v (rows of each part, with their scales and zeros) and
    of a row-parallel projection (whole groups of inputs; a per-row scale whole on every rank): the ranks'
    outputs put together (concatenated by part, summed) are the one-rank product. In-process, through the
    layers' loaders and their reference op (the all-reduce is the sum here)."""
    from heron.distributed import parallel_state
    from heron.kernels.reference import int4_linear_ref
    from heron.layers.linear import ColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    sizes, k = [64, 32, 32], 128
    parts = [_int4_tensors(n, k, group, gen) for n in sizes]
    down = _int4_tensors(48, k, group, gen)
    x = torch.randn(5, k, generator=gen)
    full_parts = [int4_linear_ref(x, **p) for p in parts]
    full_down = int4_linear_ref(x, **down)
    outs, partial_sums = [], []
    monkeypatch.setattr(parallel_state, "_world_size", 2)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_rank", rank)
        qkv, row = ColumnParallelLinear(k, sizes, bias=False), RowParallelLinear(k, 48, bias=False)
        qkv.use_int4(group, zero_point=True)
        row.use_int4(group, zero_point=True)
        for shard, tensors in enumerate(parts):
            for name, t in tensors.items():
                qkv.weight_loader(getattr(qkv, name), t, shard)
        for name, t in down.items():
            row.weight_loader(getattr(row, name), t)
        outs.append(qkv._linear(x, qkv.weight).split([n // 2 for n in sizes], dim=-1))
        partial_sums.append(row._linear(x[:, rank * k // 2 : (rank + 1) * k // 2], row.weight))
    for i, full in enumerate(full_parts):
        torch.testing.assert_close(torch.cat([outs[0][i], outs[1][i]], -1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partial_sums[0] + partial_sums[1], full_down, rtol=1e-5, atol=1e-5)


def test_a_row_parallel_split_inside_a_group_is_refused(monkeypatch):
    from heron.distributed import parallel_state
    from heron.layers.linear import RowParallelLinear

    monkeypatch.setattr(parallel_state, "_world_size", 2)
    with torch.device("meta"):
        RowParallelLinear(64, 8, bias=False).use_int4(32, zero_point=True)  # 32 inputs per rank: one group
        with pytest.raises(ValueError, match="group_size 32 does not split a projection's 16 inputs"):
            RowParallelLinear(32, 8, bias=False).use_int4(32, zero_point=True)


def test_dummy_int4_weights_are_random_nibbles_of_small_weights(checkpoints):
    """`--load-format dummy` on an int4 config (the H200 benchmarks' random weights in the real shapes)."""
    llm = LLM(checkpoints["awq"][0], kv_cache_memory=16 << 20, max_model_len=256, device="cpu", load_format="dummy")
    gate_up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert gate_up.is_int4 and gate_up.weight_zero_point is not None
    assert 0.015 < _layer_weight(gate_up).std() < 0.025
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_lora_on_an_int4_model_is_refused(checkpoints):
    with pytest.raises(ValueError, match="enable_lora with an int4"):
        LLM(checkpoints["awq"][0], kv_cache_memory=16 << 20, max_model_len=256, device="cpu", enable_lora=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["awq", "ct-sym"])
def test_cuda_int4_engine_matches_cpu_reference(fmt, checkpoints):
    """The door's W4A16 Triton kernel (bf16 activations) against the CPU's float32 reference."""
    from transformers import AutoTokenizer

    path = checkpoints[fmt][0]
    ids = AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
    cpu_llm = LLM(path, kv_cache_memory=16 << 20, max_model_len=256, device="cpu")
    gpu_llm = LLM(path, kv_cache_memory=16 << 20, max_model_len=256, dtype="bfloat16")
    for prompt in (ids, ids * 5):  # 9 rows: the split-K decode tiles; 45: the prefill tiles
        cpu, gpu = _heron_logits(cpu_llm, prompt), _heron_logits(gpu_llm, prompt).cpu()
        # bf16 activations on a random model that amplifies them: a gross error (a wrong nibble order, a
        # transposed operand, a missing zero point) is ~1
        assert (gpu - cpu).norm() / cpu.norm() < 0.1
