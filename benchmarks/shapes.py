"""Folders of the real model shapes used on the GPU (random weights: `--load-format dummy`).

    python benchmarks/shapes.py OUT_DIR   ->  OUT_DIR/{qwen3-0.6b,qwen3-8b,llama3.1-8b(-awq),qwen3-30b-a3b,gemma2-9b,
                                              gemma3-12b}/config.json + tokenizer

The Gemma folders are written from the model cards' config.json (google/gemma-2-9b; google/gemma-3-12b-it's
text_config, as a text-only Gemma3ForCausalLM with the fields transformers would default spelled out).

No machine reaches the Hugging Face hub, so the real tokenizers are not at hand. Each folder gets a
word-level tokenizer of the model's vocabulary size instead: token i is the word `w<i>`, text is the words
joined by spaces, and encoding that text gives the ids back exactly. Serving then detokenizes and
re-tokenizes real strings (the work an HTTP request costs), and random-token prompts keep their length.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-30b-a3b": dict(  # a mixture of experts: 8 of 128 experts a token, ~3.0 B of its 30.5 B weights
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "gemma2-9b": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    ),
    "gemma3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=1024,
        sliding_window_pattern=6,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, 106],
    ),
}


# Llama-3.1-8B as AutoAWQ publishes it (GEMM layout, groups of 128 with zero points): int4 weights in the real shapes
SHAPES["llama3.1-8b-awq"] = dict(
    SHAPES["llama3.1-8b"],
    quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
)


def write_tokenizer(folder: Path, vocab_size: int, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"w{bos}", eos_token=f"w{eos}").save_pretrained(folder)


def write(out: Path) -> None:
    for name, cfg in SHAPES.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "config.json").write_text(json.dumps(cfg, indent=1))
        eos = cfg["eos_token_id"]
        write_tokenizer(out / name, cfg["vocab_size"], cfg["bos_token_id"], eos[0] if isinstance(eos, list) else eos)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
