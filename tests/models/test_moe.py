"""The mixture-of-experts families' own parts (their parity with transformers: tests/models/test_parity.py): the
expert config read from config.json, per-expert checkpoint matrices stacked into the fused expert weights (or
transformers' stacked tensors taken whole), which layers are sparse."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from heron.attention.torch_ref import TorchAttentionBackend
from heron.layers.moe import FusedMoE
from heron.models.config import MoeConfig, TransformerConfig
from heron.models.llama import LlamaDecoderLayer
from heron.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from heron.models.registry import get_model_cls

BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)


def test_the_expert_config_is_read_per_family():
    mixtral = TransformerConfig.from_hf(dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=8))
    assert mixtral.moe == MoeConfig(num_experts=8, top_k=2, intermediate_size=128, renormalize=True)
    qwen2 = dict(BASE, architectures=["Qwen2MoeForCausalLM"], num_experts=6, moe_intermediate_size=32)
    qwen2 = TransformerConfig.from_hf(dict(qwen2, shared_expert_intermediate_size=48, decoder_sparse_step=2))
    assert qwen2.moe.renormalize is False and qwen2.moe.shared_expert_intermediate_size == 48  # norm_topk_prob unset
    assert [qwen2.moe.is_sparse(i) for i in range(4)] == [False, True, False, True]
    assert qwen2.attention_bias  # Qwen2's q/k/v bias (`qkv_bias`, on by default)
    qwen3 = dict(BASE, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32, norm_topk_prob=True)
    qwen3 = TransformerConfig.from_hf(
        dict(qwen3, num_local_experts=128, mlp_only_layers=[0, 3])
    )  # as transformers saves it
    assert qwen3.moe.num_experts == 128 and qwen3.moe.renormalize and qwen3.qk_norm
    assert [qwen3.moe.is_sparse(i) for i in range(4)] == [False, True, True, False]
    assert TransformerConfig.from_hf(dict(BASE, architectures=["Qwen3ForCausalLM"])).moe is None


def _model(path: str):
    cfg = TransformerConfig.from_hf(json.load(open(os.path.join(path, "config.json"))))
    model = get_model_cls(cfg.architecture)(
        cfg, TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1)
    )
    return cfg, model


@pytest.mark.parametrize("arch, prefix", [("mixtral", "block_sparse_moe"), ("qwen3_moe", "mlp")])
def test_per_expert_matrices_are_stacked_into_the_fused_weights(arch, prefix, tiny_model_dir):
    weights = load_file(os.path.join(tiny_model_dir(arch), "model.safetensors"))
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    cfg, model = _model(tiny_model_dir(arch))
    model.load_weights(weights.items())
    inter = cfg.moe.intermediate_size
    for e in (0, cfg.moe.num_experts - 1):
        name = f"model.layers.1.{prefix}.experts.{e}"
        w13 = model.get_parameter("layers.1.mlp.experts.w13_weight")[e]
        assert torch.equal(w13[:inter], weights[f"{name}.{gate}.weight"])
        assert torch.equal(w13[inter:], weights[f"{name}.{up}.weight"])
        assert torch.equal(model.get_parameter("layers.1.mlp.experts.w2_weight")[e], weights[f"{name}.{down}.weight"])
    del weights[f"model.layers.0.{prefix}.experts.3.{up}.weight"]
    with pytest.raises(ValueError, match=r"missing tensors for: \['layers.0.mlp.experts.w13_weight'\]"):
        _model(tiny_model_dir(arch))[1].load_weights(weights.items())


def test_transformers_stacked_experts_load_whole(tiny_model_dir):
    """A transformers model's own tensors (what a benchmark hands Heron) hold each layer's experts stacked."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen2_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (_, from_files), (_, from_memory) = _model(path), _model(path)
    from_files.load_weights(load_file(os.path.join(path, "model.safetensors")).items())
    from_memory.load_weights(state.items())
    for name, param in from_files.named_parameters():
        assert torch.equal(param, from_memory.get_parameter(name)), name


def test_qwen2_moe_keeps_a_dense_mlp_in_mlp_only_layers(tiny_model_dir):
    cfg, model = _model(tiny_model_dir("qwen2_moe"))  # mlp_only_layers=[1]
    assert isinstance(model.layers[0].mlp, Qwen2MoeSparseMoeBlock) and isinstance(model.layers[0].mlp.experts, FusedMoE)
    assert isinstance(model.layers[1], LlamaDecoderLayer)
    assert model.get_parameter("layers.1.mlp.gate_up_proj.weight").shape == (2 * cfg.intermediate_size, 64)
    assert model.get_parameter("layers.0.mlp.shared_expert.gate_up_proj.weight").shape == (2 * 48, 64)
