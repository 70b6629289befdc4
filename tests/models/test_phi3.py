"""Phi-3 is the Llama block with a checkpoint that stores q/k/v and gate/up fused (its parity with transformers:
tests/models/test_parity.py)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from heron.attention.torch_ref import TorchAttentionBackend
from heron.models.config import TransformerConfig
from heron.models.phi3 import Phi3ForCausalLM
from heron.models.registry import get_model_cls


def test_the_fused_checkpoint_tensors_load_whole(tiny_model_dir):
    path = tiny_model_dir("phi3")
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.gate_up_proj.weight" in weights
    assert not any(".q_proj." in n or ".gate_proj." in n for n in weights)  # nothing for `stacked` to do
    cfg = TransformerConfig.from_hf(json.load(open(os.path.join(path, "config.json"))))
    assert get_model_cls(cfg.architecture) is Phi3ForCausalLM
    model = Phi3ForCausalLM(cfg, TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1.0))
    model.load_weights(weights.items())
    for name in ("layers.1.self_attn.qkv_proj.weight", "layers.1.mlp.gate_up_proj.weight"):
        assert torch.equal(model.get_parameter(name), weights[f"model.{name}"])
