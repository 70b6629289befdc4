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


def test_longrope_rotates_with_the_short_factors_within_the_original_context(tiny_model_dir):
    """Served at max_model_len 32 (the tiny config's original context) Heron rotates with LongRoPE's short factors,
    as transformers does for sequences that short; the long ones past it are tests/models/test_parity.py's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heron import LLM, SamplingParams
    from tests.models.test_parity import capture_logits, hf_greedy

    path = tiny_model_dir("phi3-longrope")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompt = "Once upon a time, in a land far away, there lived a heron"
    ids = tok(prompt).input_ids
    llm = LLM(path, kv_cache_memory=16 << 20, max_model_len=32)
    captured = capture_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=32 - len(ids), ignore_eos=True)
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(model, tok, [prompt], 32 - len(ids))[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :]
    assert len(captured) == len(ref)
    for ours, want in zip(captured, ref):
        assert (ours[0] - want).norm() / want.norm() < 1e-4


def test_longrope_tables_follow_the_served_context():
    """The long factors (and LongRoPE's cos / sin scale) where the table passes the original context."""
    from heron.layers.rotary import RotaryEmbedding

    scaling = dict(
        rope_type="longrope",
        short_factor=(1.0,) * 4,
        long_factor=(4.0,) * 4,
        original_max_position_embeddings=16,
        attention_factor=1.5,
    )
    short, long = RotaryEmbedding(8, 16, 1e4, scaling), RotaryEmbedding(8, 64, 1e4, scaling)
    plain = RotaryEmbedding(8, 64, 1e4, None).cos_sin
    torch.testing.assert_close(short.cos_sin, 1.5 * plain[:16])
    angle = torch.outer(torch.arange(64.0), 1 / (4 * 1e4 ** (torch.arange(0, 8, 2) / 8)))
    torch.testing.assert_close(long.cos_sin, 1.5 * torch.cat([angle.cos(), angle.sin()], -1))
