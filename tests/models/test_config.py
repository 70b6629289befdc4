"""TransformerConfig.from_hf: what the shared blocks cannot compute is refused by name; sliding windows, LongRoPE
and Gemma's switches are read as transformers reads them."""

from __future__ import annotations

import logging
import math

import pytest

from heron.attention import AttentionParams
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
def test_longrope_reads_its_factors_and_the_attention_factor(kind):
    factors = dict(long_factor=[2.0] * 8, short_factor=[1.0] * 8)
    cfg = TransformerConfig.from_hf(
        _phi3(rope_scaling={"type": kind, **factors}, original_max_position_embeddings=1024)  # 4096 / 1024: s = 4
    )
    assert cfg.rope_scaling == dict(
        rope_type="longrope",
        short_factor=(1.0,) * 8,
        long_factor=(2.0,) * 8,
        original_max_position_embeddings=1024,
        attention_factor=pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024))),
    )
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        TransformerConfig.from_hf(_phi3(rope_scaling={"type": kind, **factors}))
    with pytest.raises(ValueError, match=r"head_dim / 2 \(8\)"):
        TransformerConfig.from_hf(
            _phi3(
                rope_scaling={"type": kind, "long_factor": [1.0] * 4, "short_factor": [1.0] * 4},
                original_max_position_embeddings=1024,
            )
        )


def test_other_rope_types_are_refused_by_name():
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        TransformerConfig.from_hf(dict(BASE, architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "yarn"}))


def test_partial_rotary_is_refused_in_either_place():
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75"):
        TransformerConfig.from_hf(_phi3(partial_rotary_factor=0.75))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        TransformerConfig.from_hf(_phi3(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))
    full = TransformerConfig.from_hf(_phi3(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0}))
    assert full.rope_scaling is None


def test_an_activation_other_than_silu_or_gelu_tanh_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'gelu_new' is not supported"):
        TransformerConfig.from_hf(_phi3(hidden_act="gelu_new"))
    gemma = dict(BASE, architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh", hidden_act="gelu")
    assert TransformerConfig.from_hf(gemma).hidden_act == "gelu_pytorch_tanh"  # Gemma's own name wins


def test_a_window_the_attention_honours_keeps_the_whole_context():
    cfg = TransformerConfig.from_hf(_phi3(sliding_window=2047))  # Phi-3-mini-4k's
    assert cfg.max_position_embeddings == 4096 and cfg.sliding_window == 2047
    assert [cfg.attention_params(i).sliding_window for i in range(2)] == [2047, 2047]
    unused = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=False)
    assert TransformerConfig.from_hf(unused).sliding_window is None  # Qwen2's switch is off
    wide = TransformerConfig.from_hf(_phi3(sliding_window=8192))  # a window past the context changes nothing
    assert wide.sliding_window is None and wide.attention_params(0).sliding_window is None
    assert TransformerConfig.from_hf(_phi3(sliding_window=None)).layer_types == ()


def test_which_layers_slide_follows_transformers():
    four = dict(BASE, num_hidden_layers=4, sliding_window=16)
    qwen = TransformerConfig.from_hf(
        dict(four, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=2)
    )
    assert [qwen.is_sliding(i) for i in range(4)] == [False, False, True, True]
    gemma2 = TransformerConfig.from_hf(dict(four, architectures=["Gemma2ForCausalLM"]))
    assert [gemma2.is_sliding(i) for i in range(4)] == [True, False, True, False]
    gemma3 = TransformerConfig.from_hf(dict(four, architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3))
    assert [gemma3.is_sliding(i) for i in range(4)] == [True, True, False, True]
    given = TransformerConfig.from_hf(
        dict(four, architectures=["MistralForCausalLM"], layer_types=["full_attention"] * 4)
    )
    assert given.sliding_window is None  # no sliding layer: no window
    with pytest.raises(ValueError, match="layer_types"):
        TransformerConfig.from_hf(dict(four, architectures=["MistralForCausalLM"], layer_types=["chunked"] * 4))


def test_an_architecture_without_windowed_attention_is_capped_at_its_window(caplog, monkeypatch):
    from heron.models import config

    monkeypatch.setattr(config, "SLIDING_WINDOW_ARCHITECTURES", set())
    with caplog.at_level(logging.WARNING, logger="heron.models.config"):
        cfg = TransformerConfig.from_hf(_phi3(sliding_window=2047))
    assert cfg.max_position_embeddings == 2047 and cfg.sliding_window is None
    assert "sliding_window=2047" in caplog.text and "capped at 2047 tokens" in caplog.text


def test_gemma_attention_and_logits_switches():
    hf = dict(
        BASE,
        architectures=["Gemma2ForCausalLM"],
        head_dim=32,
        query_pre_attn_scalar=144,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=1024,
    )
    cfg = TransformerConfig.from_hf(hf)
    assert cfg.attention_params(0) == AttentionParams(144**-0.5, sliding_window=1024, logits_soft_cap=50.0)
    assert cfg.attention_params(1) == AttentionParams(144**-0.5, logits_soft_cap=50.0)
    assert cfg.final_logit_softcap == 30.0 and cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        TransformerConfig.from_hf(dict(hf, use_bidirectional_attention=True))


def test_gemma3_rope_per_layer_type_in_either_format():
    old = dict(
        BASE,
        architectures=["Gemma3ForCausalLM"],
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
    )
    new = dict(
        BASE,
        architectures=["Gemma3ForCausalLM"],
        sliding_window=512,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    for hf in (old, new):
        cfg = TransformerConfig.from_hf(hf)
        assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4) and cfg.qk_norm
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    new["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="sliding layers"):
        TransformerConfig.from_hf(new)


def test_gemma3_conditional_generation_reads_its_language_model_with_defaults():
    """A hub config.json gives only what differs from transformers' defaults (gemma-3-4b-it's text_config)."""
    hf = dict(
        architectures=["Gemma3ForConditionalGeneration"],
        eos_token_id=[1, 106],
        text_config=dict(
            hidden_size=2560,
            intermediate_size=10240,
            model_type="gemma3_text",
            num_hidden_layers=34,
            rope_scaling={"factor": 8.0, "rope_type": "linear"},
            sliding_window=1024,
        ),
        vision_config=dict(model_type="siglip_vision_model"),
    )
    cfg = TransformerConfig.from_hf(hf)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.eos_token_ids == (1, 106)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.query_scale == 256**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert [cfg.is_sliding(i) for i in range(6)] == [True] * 5 + [False] and cfg.sliding_window == 1024
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


def test_the_model_type_names_the_architecture_without_architectures():
    cfg = TransformerConfig.from_hf(dict(BASE, model_type="phi3"))
    assert cfg.architecture == "Phi3ForCausalLM" and not cfg.attention_bias and not cfg.qk_norm
