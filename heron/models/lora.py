"""LoRA on a decoder model: `add_lora` wraps each layer's four projections (q/k/v, o, gate/up, down) with their
slot stacks (heron/layers/lora.py), and `load_adapter` reads a PEFT adapter folder into the stacks' layout,
mapping its separate q/k/v and gate/up matrices onto Heron's fused projections.

An adapter is checked whole before it is used: a file missing, a module Heron cannot place, a shape that is
not the base model's or a rank over `max_lora_rank` is a ValueError naming it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from heron.layers.layernorm import NormLinear
from heron.layers.lora import LinearWithLoRA, LoRAMapping, LoRAStack, NormLinearWithLoRA

# PEFT module name -> (Heron projection, part of it)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

Stacks = dict[tuple[int, str], LoRAStack]  # (layer, projection) -> its stack


@dataclass
class LoRAAdapter:
    """An adapter in the stacks' layout, on the host: per (layer, projection), A [parts * max_rank, in] and
    transposed, scaled B [parts * max_rank, out], zero where the adapter has no matrix."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def add_lora(model: nn.Module, max_loras: int, max_rank: int, mapping: LoRAMapping) -> Stacks:
    """Wrap every decoder layer's projections of `model` (built and loaded) with LoRA stacks on its device."""
    stacks: Stacks = {}
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn, mlp = layer.self_attn, layer.mlp
        if not (isinstance(layer.input_layernorm, NormLinear) and hasattr(mlp, "gate_up_proj")):
            raise ValueError(f"enable_lora: {type(model).__name__} is not supported (dense decoder models only).")
        if attn.o_proj.is_int4 or attn.qkv_proj.is_int4:
            raise ValueError("enable_lora with an int4 (AWQ / GPTQ / compressed-tensors) model is not supported.")
        norm = layer.input_layernorm.weight  # in the model's dtype where an FP8 projection's weight is not
        device, dtype = norm.device, norm.dtype

        def stack(input_size: int, output_sizes: list[int]) -> LoRAStack:
            return LoRAStack(input_size, output_sizes, max_loras, max_rank, mapping).to(device, dtype)

        qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
        hidden = qkv.weight.shape[1]
        stacks[i, "qkv_proj"] = stack(hidden, qkv.output_sizes)
        stacks[i, "o_proj"] = stack(attn.o_proj.input_size, [attn.o_proj.output_size])
        stacks[i, "gate_up_proj"] = stack(hidden, gate_up.output_sizes)
        down = mlp.down_proj
        stacks[i, "down_proj"] = stack(down.input_size, [down.output_size])
        act = "silu" if down.swiglu else "gelu_tanh" if down.geglu else None
        if act is not None:  # gate/up's delta added inside the activation (on CUDA past 16 rows)
            stacks[i, "gate_up_proj"].gives = stacks[i, "down_proj"].takes = [None]
        for name, proj in (("qkv_proj", qkv), ("o_proj", attn.o_proj), ("gate_up_proj", gate_up), ("down_proj", down)):
            if proj.weight.dtype == dtype and proj.bias is None:  # every slot's A rows under the base weight
                stacks[i, name].extend(proj)
        layer.input_layernorm = NormLinearWithLoRA(layer.input_layernorm, stacks[i, "qkv_proj"])
        layer.post_attention_layernorm = NormLinearWithLoRA(layer.post_attention_layernorm, stacks[i, "gate_up_proj"])
        attn.o_proj = LinearWithLoRA(attn.o_proj, stacks[i, "o_proj"], None)
        mlp.down_proj = LinearWithLoRA(down, stacks[i, "down_proj"], act)
    if not stacks:
        raise ValueError(f"enable_lora: {type(model).__name__} has no decoder layers to adapt.")
    return stacks


def load_adapter(name: str, path: str, stacks: Stacks, max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at `path` (adapter_config.json, adapter_model.safetensors) and check it against
    the stacks it is for."""
    from safetensors.torch import load_file

    config_path, weights_path = (
        os.path.join(path, "adapter_config.json"),
        os.path.join(path, "adapter_model.safetensors"),
    )
    for f in (config_path, weights_path):
        if not os.path.isfile(f):
            raise ValueError(f"LoRA adapter {name!r}: {f} not found.")
    with open(config_path) as f:
        cfg = json.load(f)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank ({max_rank}).")
    for unsupported in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(unsupported):
            raise ValueError(f"LoRA adapter {name!r}: {unsupported} is not supported.")
    if cfg.get("bias", "none") != "none" or cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: only plain LoRA (bias 'none', no DoRA) is supported.")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(weights_path)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA matrix.")
            continue
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        layer, module = _place(name, key)
        proj, part = TARGETS[module]
        st = stacks.get((layer, proj))
        if st is None or b is None:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} has no layer {layer} or no lora_B beside it.")
        in_size, out_size = st.input_size, st.output_sizes[part]
        if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: {module} of layer {layer} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"the base model needs ({rank}, {in_size}) and ({out_size}, {rank})."
            )
        if (layer, proj) not in weights:
            rows = len(st.output_sizes) * max_rank
            weights[layer, proj] = (torch.zeros(rows, in_size), torch.zeros(rows, sum(st.output_sizes)))
        stacked_a, stacked_b = weights[layer, proj]
        rows, cols = slice(part * max_rank, part * max_rank + rank), sum(st.output_sizes[:part])
        stacked_a[rows] = a.float()
        stacked_b[rows, cols : cols + out_size] = b.float().t() * scale
    return LoRAAdapter(name, rank, weights)


def _place(name: str, key: str) -> tuple[int, str]:
    """(layer index, PEFT module name) of a tensor named like `base_model.model.model.layers.3.self_attn.q_proj
    .lora_A.weight`."""
    parts = key.split(".")
    try:
        i = parts.index("layers")
        layer, module = int(parts[i + 1]), parts[parts.index("lora_A") - 1]
    except (ValueError, IndexError):
        raise ValueError(f"LoRA adapter {name!r}: cannot place tensor {key!r} in a decoder layer.") from None
    if module not in TARGETS:
        raise ValueError(f"LoRA adapter {name!r}: target module {module!r} is not supported (one of {list(TARGETS)}).")
    return layer, module
