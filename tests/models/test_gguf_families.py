"""GGUF files of the families beyond llama and dense Qwen: a tiny random checkpoint of each is written here as
llama.cpp's converter writes it (its tensor names, its metadata keys, Gemma's norms stored as 1 + w, each
projection of all experts stacked, Phi-3's LongRoPE factors as tensors), with the embedded model's tokenizer;
Heron's greedy tokens from the file must equal transformers' on the original checkpoint."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from heron import LLM
from heron.models.gguf_loader import load_gguf
from heron.models.loader import embedded_model_path
from tests.conftest import SLIDING_WINDOW, TINY
from tests.models.test_parity import GREEDY, PROMPTS, hf_greedy

_NAMES = {  # Hugging Face module -> llama.cpp's block tensor
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: both halves in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _config(arch: str, vocab: int, bos: int, eos: int):
    import transformers as t

    common = dict(TINY, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    moe = dict(num_experts=8, moe_intermediate_size=32)
    # Gemma's query scale is head_dim (llama.cpp stores none); Gemma 3 ties its embeddings.
    gemma = dict(common, head_dim=32, query_pre_attn_scalar=32, sliding_window=SLIDING_WINDOW, pad_token_id=0)
    return {
        "gemma2": lambda: t.Gemma2Config(**gemma, attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
        "gemma3": lambda: t.Gemma3TextConfig(
            **dict(gemma, tie_word_embeddings=True),
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
        "phi3": lambda: t.Phi3Config(
            **common,
            pad_token_id=0,
            original_max_position_embeddings=32,
            sliding_window=SLIDING_WINDOW,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0 + i / 8 for i in range(8)],
                long_factor=[2.0 + i for i in range(8)],
            ),
        ),
        "qwen2moe": lambda: t.Qwen2MoeConfig(  # layer 1 dense: a block without a router
            **common, **moe, num_experts_per_tok=4, shared_expert_intermediate_size=48, mlp_only_layers=[1]
        ),
        "qwen3moe": lambda: t.Qwen3MoeConfig(**common, **moe, head_dim=32, num_experts_per_tok=3, norm_topk_prob=True),
    }[arch]()


def _to_gguf(arch: str, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Rename and reshape as llama.cpp's converter does."""
    names = _NAMES | (_GEMMA_NAMES if arch.startswith("gemma") else {})
    out = {}
    for name, t in state.items():
        a = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp's RMSNorm scales by w; Gemma's by 1 + w
        if not name.startswith("model.layers."):
            key = {
                "model.embed_tokens.weight": "token_embd",
                "model.norm.weight": "output_norm",
                "lm_head.weight": "output",
            }
            out[key[name] + ".weight"] = a
            continue
        _, _, i, *mid, kind = name.split(".")
        module = ".".join(mid)
        if module == "mlp.experts" and kind == "gate_up_proj":  # [E, 2I, H] -> gate and up [E, I, H]
            gate, up = np.split(a, 2, axis=1)
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gate, up
        elif module == "mlp.experts":
            out[f"blk.{i}.ffn_down_exps.weight"] = a
        elif module == "mlp.shared_expert_gate":
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = a[0]  # stored [H]
        else:
            out[f"blk.{i}.{names[module]}.{kind}"] = a
    return out


def _write(path: str, arch: str, cfg, tensors: dict[str, np.ndarray], tokenizer: gguf.GGUFReader) -> str:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if arch.startswith("gemma"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
    if arch == "phi3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        tensors["rope_factors_long.weight"] = np.array(cfg.rope_parameters["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(cfg.rope_parameters["short_factor"], dtype=np.float32)
    if arch.endswith("moe"):
        w.add_key_length(cfg.head_dim if arch == "qwen3moe" else cfg.hidden_size // cfg.num_attention_heads)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        w.add_string(key, tokenizer.fields[key].contents())
    w.add_token_list(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(tokenizer.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(tokenizer.fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizer_file() -> gguf.GGUFReader:
    return gguf.GGUFReader(embedded_model_path())


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe"])
def test_greedy_from_gguf_matches_transformers_on_the_checkpoint(arch, tmp_path, embedded_tokenizer, tokenizer_file):
    from transformers import AutoModelForCausalLM

    tok = embedded_tokenizer
    torch.manual_seed(0)
    cfg = _config(arch, len(tok), tok.bos_token_id, tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # wider than the default init, so that logits are not flat (and Gemma's norms not 0)
        for p in model.parameters():
            p.normal_(0, 0.1)
    state = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    path = _write(str(tmp_path / f"tiny-{arch}.gguf"), arch, cfg, _to_gguf(arch, state), tokenizer_file)

    source = load_gguf(path)
    assert source.hf_config["architectures"] == [type(model).__name__]
    llm = LLM(path, kv_cache_memory=32 << 20)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, tok, PROMPTS, 12)


def test_mixtral_file_is_refused_by_name(tmp_path):
    experts = {"blk.0.ffn_gate_exps.weight": np.zeros((8, 32, 64), np.float32)}
    tensors = {"token_embd.weight": np.zeros((300, 64), np.float32), **experts}
    w = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    w.add_block_count(1)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="Mixtral"):
        load_gguf(str(tmp_path / "mixtral.gguf"))
