"""TransformerConfig.from_hf: what the shared blocks cannot compute is refused by name; a sliding window caps the
context where attending over the whole sequence is the same."""

from __future__ import annotations

import logging

import pytest

from heron.models.config import TransformerConfig

BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _phi3(**extra) -> dict:
    return dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", **extra)


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_longrope_is_refused_by_name(kind):
    long_context = _phi3(rope_scaling={"type": kind, "long_factor": [1.0] * 8, "short_factor": [1.0] * 8})
    with pytest.raises(ValueError, match=f"rope_type '{kind}' is not supported"):
        TransformerConfig.from_hf(long_context)


def test_partial_rotary_is_refused_in_either_place():
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75"):
        TransformerConfig.from_hf(_phi3(partial_rotary_factor=0.75))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        TransformerConfig.from_hf(_phi3(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))
    full = TransformerConfig.from_hf(_phi3(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0}))
    assert full.rope_scaling is None


def test_an_activation_other_than_silu_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'gelu_new' is not supported"):
        TransformerConfig.from_hf(_phi3(hidden_act="gelu_new"))


def test_a_sliding_window_caps_the_context_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="heron.models.config"):
        cfg = TransformerConfig.from_hf(_phi3(sliding_window=2047))  # Phi-3-mini-4k's
    assert cfg.max_position_embeddings == 2047
    assert "sliding_window=2047" in caplog.text and "capped at 2047 tokens" in caplog.text
    unused = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=False)
    assert TransformerConfig.from_hf(unused).max_position_embeddings == 4096  # Qwen2's switch is off
    wide = _phi3(sliding_window=8192)  # a window past the context changes nothing
    assert TransformerConfig.from_hf(wide).max_position_embeddings == 4096
    assert TransformerConfig.from_hf(_phi3(sliding_window=None)).max_position_embeddings == 4096


def test_the_model_type_names_the_architecture_without_architectures():
    cfg = TransformerConfig.from_hf(dict(BASE, model_type="phi3"))
    assert cfg.architecture == "Phi3ForCausalLM" and not cfg.attention_bias and not cfg.qk_norm
