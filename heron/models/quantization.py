"""FP8 (e4m3) W8A8 weights: which checkpoints hold them, which layers take them, and online quantization.

Three sources, one layout in memory (heron/layers/linear.py `use_fp8`: float8 weight, float32 scale per output
row; the matmul door's FP8 GEMM with per-token activation scales):
- compressed-tensors (`quant_method: compressed-tensors`, format float-quantized, 8-bit float weights per
  channel or per tensor): `weight` + `weight_scale` per layer, the `ignore` list left in 16 bits;
- HF / vLLM `quant_method: fp8` (per-tensor `weight_scale`, `ignored_layers` / `modules_to_not_convert`);
- `--quantization fp8` on a 16/32-bit checkpoint: each projection's rows quantized as they stream in.
A checkpoint's static `input_scale` is dropped: activations are always scaled per token, at run time.
Every column/row-parallel projection is quantized (attention's q/k/v and o, the MLP's); the embedding, LM head,
norms and an MoE router stay as they are. Mixture-of-experts models are refused (their experts would need an
FP8 fused-MoE kernel). `--load-format dummy`'s random weights are made here too, FP8 ones quantized as online
quantization would.
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

QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "fp8"
    ignore: tuple[str, ...] = ()  # checkpoint module names ("re:" a regular expression) left unquantized

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)


def quantization_config(hf_config: dict[str, Any], requested: str | None) -> QuantizationConfig | None:
    """The checkpoint's `quantization_config` (config.json), or `requested` (`--quantization`) for a checkpoint
    without one; an unsupported scheme is refused by name."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}.")
    qc = hf_config.get("quantization_config")
    if qc is None:
        return QuantizationConfig(method=requested) if requested else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        ignore = tuple(qc.get("ignore") or ())
        for name, group in (qc.get("config_groups") or {}).items():
            _check_compressed_tensors_group(name, group, qc.get("format"))
    elif method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"block-wise FP8 (weight_block_size {qc['weight_block_size']}) is not supported.")
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    else:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported (supported: compressed-tensors FP8, fp8)."
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError("a quantized KV cache scheme in the checkpoint (kv_cache_scheme) is not supported.")
    return QuantizationConfig(method="fp8", ignore=ignore)


def _check_compressed_tensors_group(name: str, group: dict[str, Any], fmt: str | None) -> None:
    w, a = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or fmt
    float8 = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
    if fmt != "float-quantized" or not float8 or (a and (a.get("num_bits") != 8 or a.get("type") != "float")):
        raise ValueError(
            f"compressed-tensors group {name!r} ({fmt}, weights {w}) is not supported: only float-quantized FP8 "
            "weights per channel or per tensor (activations FP8 or none)."
        )


def quantize_layers(model: nn.Module, hf_config: dict[str, Any], requested: str | None) -> QuantizationConfig | None:
    """Give every projection not ignored an FP8 weight where the checkpoint or `--quantization` says so (before
    the weights load, on `meta` too), then rebind every module's ops (a NormLinear reads its projection's).
    Returns the quantization config (None: nothing quantized)."""
    qcfg = quantization_config(hf_config, requested)
    if qcfg is None:
        return None
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        raise ValueError("FP8 quantization of mixture-of-experts models is not supported.")
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
        module.use_fp8()
    for module in model.modules():
        if isinstance(module, DeviceOps):
            module.bind_ops()
    return qcfg


def _fused_parts(model: nn.Module) -> list[tuple[str, str]]:
    """(fused name piece, checkpoint name piece) pairs, e.g. ("qkv_proj", "q_proj"), from the model's `stacked`."""
    return [(fused, piece) for piece, (fused, _) in getattr(model, "stacked", {}).items()]


def quantized_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream as the FP8 layers load it: a 16/32-bit weight bound for an FP8 parameter is
    quantized per row (yielded with its `weight_scale`), and static activation scales are dropped."""
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
        if p.dtype == FP8_DTYPE:
            q, scale = quantize_fp8_rows(torch.empty(p.shape, device=p.device).normal_(0.0, 0.02, generator=gen))
            p.copy_(q)
            params[name.removesuffix("weight") + "weight_scale"].copy_(scale)
        elif name.endswith("weight_scale"):
            continue  # filled with its weight
        elif p.dim() > 1:
            p.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()
