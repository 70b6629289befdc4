"""Quantized weights: which checkpoints hold them, which layers take them, and online quantization.

FP8 (e4m3) W8A8, three sources, one layout in memory (heron/layers/linear.py `use_fp8`: float8 weight, float32
scale per output row; the matmul door's FP8 GEMM with per-token activation scales):
- compressed-tensors (`quant_method: compressed-tensors`, format float-quantized, 8-bit float weights per
  channel or per tensor): `weight` + `weight_scale` per layer, the `ignore` list left in 16 bits;
- HF / vLLM `quant_method: fp8` (per-tensor `weight_scale`, `ignored_layers` / `modules_to_not_convert`);
- `--quantization fp8` on a 16/32-bit checkpoint: each projection's rows quantized as they stream in.
A checkpoint's static `input_scale` is dropped: activations are always scaled per token, at run time.
Int4 weight-only (W4A16), read from AWQ (GEMM), GPTQ (`desc_act: false`) and compressed-tensors pack-quantized
checkpoints, never made here: each format's tensors converted to one layout as they stream in
(int4_formats.py; heron/layers/linear.py `use_int4`), the ignore list (`modules_to_not_convert`) left in 16 bits.
Every column/row-parallel projection is quantized (attention's q/k/v and o, the MLP's); the embedding, LM head,
norms and an MoE router stay as they are. Mixture-of-experts models are refused (their experts would need a
quantized fused-MoE kernel). `--load-format dummy`'s random weights are made here too, FP8 ones quantized as
online quantization would, int4 ones random nibbles.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heron.kernels.gemm.fp8 import FP8_DTYPE, quantize_fp8_rows
from heron.layers.device_ops import DeviceOps
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear
from heron.layers.moe import FusedMoE
from heron.models.int4_formats import int4_weights

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "fp8" (either FP8 source), or the int4 checkpoint's format: "awq", "gptq", "compressed-tensors"
    ignore: tuple[str, ...] = ()  # checkpoint module names ("re:" a regular expression) left unquantized
    bits: int = 8  # 8: FP8 W8A8; 4: int4 weight-only
    group_size: int = -1  # int4: inputs per scale (-1: one group per row)
    zero_point: bool = False  # int4: the checkpoint stores zero points (else the zero is 8)
    gptq_v1: bool = False  # GPTQ's v1 format stores each zero point minus 1

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)


def quantization_config(hf_config: dict[str, Any], requested: str | None) -> QuantizationConfig | None:
    """The checkpoint's `quantization_config` (config.json), or `requested` (`--quantization`) for a checkpoint
    without one (fp8 only: the int4 formats are read, never made); an unsupported scheme is refused by name, and
    so is a `requested` method the checkpoint does not hold."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}.")
    qc = hf_config.get("quantization_config")
    if qc is None:
        if requested not in (None, "fp8"):
            raise ValueError(
                f"quantization {requested!r} reads a checkpoint quantized so, but config.json has no "
                "quantization_config (only fp8 quantizes a 16/32-bit checkpoint while loading)."
            )
        return QuantizationConfig(method=requested) if requested else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        cfg = _compressed_tensors_config(qc)
    elif method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"block-wise FP8 (weight_block_size {qc['weight_block_size']}) is not supported.")
        cfg = QuantizationConfig("fp8", tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))
    elif method in ("awq", "gptq"):
        cfg = _awq_config(qc) if method == "awq" else _gptq_config(qc)
    else:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported (supported: compressed-tensors FP8 and "
            "pack-quantized int4, fp8, awq, gptq)."
        )
    if requested is not None and requested != method and not (requested == "fp8" and cfg.bits == 8):
        raise ValueError(
            f"quantization {requested!r} does not match the checkpoint's quantization_config.quant_method {method!r}."
        )
    if (kv := qc.get("kv_cache_scheme")) and not (
        kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy", "tensor") == "tensor"
    ):
        # (the per-tensor float8 scheme's k_scale / v_scale load into the layers' AttentionParams)
        raise ValueError(f"kv_cache_scheme {kv} is not supported: only per-tensor float8 KV-cache scales are.")
    return cfg


def _compressed_tensors_config(qc: dict[str, Any]) -> QuantizationConfig:
    """FP8 (float-quantized, per channel or tensor) or int4 weight-only (pack-quantized, per group or channel)
    groups, one kind per checkpoint."""
    kinds = {
        _compressed_tensors_group(name, g, qc.get("format")) for name, g in (qc.get("config_groups") or {}).items()
    }
    if len(kinds) > 1:
        raise ValueError(f"compressed-tensors config_groups mix schemes ({sorted(map(str, kinds))}): not supported.")
    kind = kinds.pop() if kinds else ("fp8",)
    ignore = tuple(qc.get("ignore") or ())
    if kind[0] == "fp8":
        return QuantizationConfig("fp8", ignore)
    return QuantizationConfig("compressed-tensors", ignore, bits=4, group_size=kind[1], zero_point=kind[2])


def _compressed_tensors_group(name: str, group: dict[str, Any], fmt: str | None) -> tuple:
    """("fp8",) or ("int4", group size, zero points) for one config group; anything else refused by name."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or fmt
    float8 = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
    if fmt == "float-quantized" and float8 and (not a or (a.get("num_bits") == 8 and a.get("type") == "float")):
        return ("fp8",)
    int4 = w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") in ("group", "channel")
    if fmt == "pack-quantized" and int4 and not a and not w.get("actorder"):
        group = (w.get("group_size") or -1) if w["strategy"] == "group" else -1
        return ("int4", group, not w.get("symmetric", True))
    raise ValueError(
        f"compressed-tensors group {name!r} ({fmt}, weights {w}, input_activations {a}) is not supported: only "
        "float-quantized FP8 weights per channel or per tensor (activations FP8 or none), or pack-quantized int4 "
        "weights per group or channel without activation quantization or actorder."
    )


def _awq_config(qc: dict[str, Any]) -> QuantizationConfig:
    """AutoAWQ's GEMM layout, 4 bits, zero points (or none with `zero_point: false`)."""
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ bits {bits} is not supported (only 4).")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout).")
    ignore = tuple(f"re:.*{re.escape(m)}.*" for m in qc.get("modules_to_not_convert") or ())
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return QuantizationConfig("awq", ignore, bits=4, group_size=group, zero_point=qc.get("zero_point", True))


def _gptq_config(qc: dict[str, Any]) -> QuantizationConfig:
    """AutoGPTQ / GPTQModel, 4 bits, without act-order; symmetric or not (both store zero points)."""
    if qc.get("bits") != 4:
        raise ValueError(f"GPTQ bits {qc.get('bits')} is not supported (only 4).")
    if qc.get("desc_act"):
        raise ValueError("GPTQ desc_act true (act-order) is not supported: the inputs' groups would be permuted.")
    if qc.get("dynamic"):
        raise ValueError("GPTQ dynamic (per-module bits / group sizes) is not supported.")
    if qc.get("lm_head"):
        raise ValueError("GPTQ lm_head true (a quantized LM head) is not supported.")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2).")
    ignore = tuple(f"re:.*{re.escape(m)}.*" for m in qc.get("modules_to_not_convert") or ())
    group = qc.get("group_size", 128)
    return QuantizationConfig("gptq", ignore, bits=4, group_size=group, zero_point=True, gptq_v1=fmt == "gptq")


def quantize_layers(model: nn.Module, hf_config: dict[str, Any], requested: str | None) -> QuantizationConfig | None:
    """Give every projection not ignored an FP8 or int4 weight where the checkpoint or `--quantization` says so (before
    the weights load, on `meta` too), then rebind every module's ops (a NormLinear reads its projection's).
    Returns the quantization config (None: nothing quantized)."""
    qcfg = quantization_config(hf_config, requested)
    if qcfg is None:
        return None
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        raise ValueError(f"{qcfg.method} quantization of mixture-of-experts models is not supported.")
    parts = _fused_parts(model)
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        names = [f"model.{name.replace(fused, p)}" for fused, p in parts if f".{fused}" in name] or [f"model.{name}"]
        ignored = [qcfg.ignores(n) for n in names]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"{names} are fused in Heron, but the checkpoint quantizes only some of them.")
        if qcfg.bits == 4:
            module.use_int4(qcfg.group_size, qcfg.zero_point)
        else:
            module.use_fp8()
    for module in model.modules():
        if isinstance(module, DeviceOps):
            module.bind_ops()
    return qcfg


def _fused_parts(model: nn.Module) -> list[tuple[str, str]]:
    """(fused name piece, checkpoint name piece) pairs, e.g. ("qkv_proj", "q_proj"), from the model's `stacked`."""
    return [(fused, piece) for piece, (fused, _) in getattr(model, "stacked", {}).items()]


def quantized_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], qcfg: QuantizationConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream as the quantized layers load it: an int4 format's tensors converted to Heron's
    layout (int4_formats.py); for FP8 a 16/32-bit weight bound for an FP8 parameter is quantized per row
    (yielded with its `weight_scale`), and static activation scales are dropped."""
    if qcfg.bits == 4:
        yield from int4_weights(weights, qcfg.method, qcfg.group_size, qcfg.gptq_v1)
        return
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(".weight") and tensor.dtype != FP8_DTYPE:
            target, _ = model.checkpoint_target(name.removeprefix("model."))
            if target in params and params[target].dtype == FP8_DTYPE:
                q, scale = quantize_fp8_rows(tensor.to(params[target].device))  # on the GPU where there is one
                yield name, q
                yield name.removesuffix("weight") + "weight_scale", scale
                continue
        yield name, tensor


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in the real shapes, for benchmarks (`--load-format dummy`): small normal matrices, unit
    norms, zero biases; an FP8 projection's rows quantized as `--quantization fp8` would (so it lives here)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.dtype == torch.int32:  # int4: random nibbles, scales giving weights of std ~0.02, zero points 8
            p.copy_(torch.randint(-(2**31), 2**31, p.shape, device=p.device, generator=gen, dtype=torch.int64))
            params[name.removesuffix("weight") + "weight_scale"].fill_(0.02 / 4.6)
            if (zero := params.get(name.removesuffix("weight") + "weight_zero_point")) is not None:
                zero.fill_(8)
        elif p.dtype == FP8_DTYPE:
            q, scale = quantize_fp8_rows(torch.empty(p.shape, device=p.device).normal_(0.0, 0.02, generator=gen))
            p.copy_(q)
            params[name.removesuffix("weight") + "weight_scale"].copy_(scale)
        elif name.endswith(("weight_scale", "weight_zero_point")):
            continue  # filled with its weight
        elif p.dim() > 1:
            p.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()
