"""GGUF loading: the embedded SmolLM2 file against transformers' own GGUF loading, the q/k un-permutation
against llama.cpp's interleaved RoPE, and small files written here for the other architectures, RoPE
scaling and the error paths."""

from __future__ import annotations

import functools
import math
import os
import re

import gguf
import numpy as np
import pytest
import torch

from heron.layers.rotary import RotaryEmbedding, rope_inv_freq
from heron.models.config import TransformerConfig
from heron.models.gguf_loader import load_gguf
from heron.models.loader import embedded_model_path
from heron.models.registry import get_model_cls

# --- the embedded model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded() -> str:
    return embedded_model_path()


@pytest.fixture(scope="module")
def source(embedded):
    return load_gguf(embedded)


@pytest.fixture(scope="module")
def weights(source) -> dict[str, torch.Tensor]:
    return dict(source.weights())


@pytest.fixture(scope="module")
def reader(embedded):
    return gguf.GGUFReader(embedded)


@pytest.fixture(scope="module")
def reference(embedded, source):
    """What transformers makes of the same file: its config dict and its dequantized, un-permuted tensors.

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` insists on `accelerate`, which Heron does not
    install; for llama it hands the file to `load_gguf_checkpoint` (the GGUF quantizer's legacy path), so the
    test calls that directly. The meta-device model only lends its parameter names to map the GGUF names
    onto (the config compared is the one transformers parses from the file in the same call)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in source.hf_config.items() if k != "architectures"}))
    # transformers rebuilds gguf's tensor-name table for each of the model's ~400 submodules (seconds);
    # the table depends only on (architecture, layer count), so a cached one is the same table, sooner.
    uncached = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(uncached)
    try:
        parsed = load_gguf_checkpoint(embedded, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map = uncached
    return parsed["config"], parsed["tensors"]


def test_config_matches_transformers(source, reference):
    ours, (theirs, _) = source.hf_config, reference
    assert ours["architectures"] == ["LlamaForCausalLM"] and theirs["model_type"] == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == theirs[key], key
    assert ours["rope_theta"] == pytest.approx(theirs["rope_theta"])
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    assert ours["rms_norm_eps"] == 1e-5  # the float32 in the file, read back as the decimal it came from
    assert ours["tie_word_embeddings"] is True and "rope_scaling" not in ours
    assert source.generation_config["eos_token_id"] == 2
    cfg = TransformerConfig.from_hf(ours)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_weights_match_transformers(weights, reference):
    _, theirs = reference
    theirs = {k: v for k, v in theirs.items() if k != "lm_head.weight"}  # tied: absent from the file
    assert "lm_head.weight" not in weights
    assert set(weights) == set(theirs)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_unpermuted_qk_reproduce_llama_cpp_attention_scores(reader, weights, source):
    """Independent of transformers: llama.cpp rotates adjacent pairs of the file's q/k rows; Heron's RoPE
    rotates halves of the un-permuted rows. Both must give the same attention scores."""
    cfg = TransformerConfig.from_hf(source.hf_config)
    raw = {
        t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        for t in reader.tensors
        if t.name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight")
    }
    torch.manual_seed(0)
    x = torch.randn(7, cfg.hidden_size)
    pos = torch.arange(7) * 13  # far enough apart that every frequency turns

    def scores(q, k):
        k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    def llama_cpp_rope(v):  # v [T, H, D]; pairs (2i, 2i+1) turn by pos * theta^(-2i/D)
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
        ang = pos[:, None, None].float() * inv
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)

    q = (x @ raw["blk.3.attn_q.weight"].T).view(7, cfg.num_heads, cfg.head_dim)
    k = (x @ raw["blk.3.attn_k.weight"].T).view(7, cfg.num_kv_heads, cfg.head_dim)
    expected = scores(llama_cpp_rope(q), llama_cpp_rope(k))

    rope = RotaryEmbedding(cfg.head_dim, 128, cfg.rope_theta, cfg.rope_scaling)

    def heron_scores(wq, wk):
        q = (x @ wq.T).view(7, cfg.num_heads, cfg.head_dim)
        k = (x @ wk.T).view(7, cfg.num_kv_heads, cfg.head_dim)
        return scores(*rope(pos, q, k))

    ours = heron_scores(
        weights["model.layers.3.self_attn.q_proj.weight"], weights["model.layers.3.self_attn.k_proj.weight"]
    )
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-3)
    assert expected.abs().max() > 10  # scores of a real size, far above the tolerance
    # and the rows as the file stores them would not do: the un-permutation is not a no-op
    as_stored = heron_scores(raw["blk.3.attn_q.weight"], raw["blk.3.attn_k.weight"])
    assert not torch.allclose(as_stored, expected, rtol=1e-4, atol=1e-3)


def test_weights_are_lazy_and_fit_the_model(source, weights):
    it = source.weights()
    assert iter(it) is it and not isinstance(it, (list, tuple))
    name, first = next(it)
    assert name == "model.embed_tokens.weight" and first.shape == (49152, 576)
    _load_into_heron_model(source.hf_config, weights.items())  # every parameter covered, every shape right


def _load_into_heron_model(hf_config, weights):
    cfg = TransformerConfig.from_hf(hf_config)
    with torch.device("meta"):  # uninitialised memory: load_weights overwrites every parameter anyway
        model = get_model_cls(cfg.architecture)(cfg, None)
    model.to_empty(device="cpu").load_weights(weights)
    return cfg


def test_tokenizer_matches_transformers(source, embedded_tokenizer, reader):
    tok, ref = source.tokenizer, embedded_tokenizer
    for text in [
        "Hello world!",
        "  leading spaces\tand tabs\n\nnewlines",
        "Café, naïve, 日本語, 🙂",
        "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n",
        "",
    ]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == text
    template = reader.fields["tokenizer.chat_template"].contents()
    assert tok.chat_template == template
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("cut", ["empty", "header", "metadata", "tensor_data", "garbage"])
def test_corrupt_file_raises_naming_it(embedded, tmp_path, cut):
    n = {"empty": 0, "header": 20, "metadata": 500_000, "tensor_data": os.path.getsize(embedded) // 2, "garbage": 0}[
        cut
    ]
    bad = tmp_path / f"broken-{cut}.gguf"
    with open(embedded, "rb") as f:
        bad.write_bytes(f.read(n) if cut != "garbage" else b"not a gguf file at all" * 64)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_gguf(str(bad))


# --- small files written here ------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, so that any text tokenizes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


TOKENS = ["<|endoftext|>", "<s>", "</s>", *_byte_level_alphabet(), "he", "ll", "hell", "hello"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama's q/k rows: each head's two halves
    [x_0..x_{d/2-1}], [x_{d/2}..x_{d-1}] are interleaved into x_0, x_{d/2}, x_1, x_{d/2+1}, ..."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(
    path,
    arch: str,
    tensors: dict[str, np.ndarray],
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    layers: int,
    extra=None,
    vocab_size: bool = True,
) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    if vocab_size:
        w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
    w.add_token_merges(["h e", "l l", "he ll", "hell o"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    if extra:
        extra(w)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _hf_tensors(hidden, heads, kv_heads, head_dim, ffn, layers, *, bias=False, qk_norm=False, untied=False):
    """Random tensors under Hugging Face names, in Hugging Face layout."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": r(len(TOKENS), hidden), "model.norm.weight": r(hidden)}
    if untied:
        out["lm_head.weight"] = r(len(TOKENS), hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": r(ffn, hidden),
            p + "mlp.up_proj.weight": r(ffn, hidden),
            p + "mlp.down_proj.weight": r(hidden, ffn),
            p + "input_layernorm.weight": r(hidden),
            p + "post_attention_layernorm.weight": r(hidden),
        }
        if bias:
            out |= {
                p + f"self_attn.{x}_proj.bias": r(n * head_dim)
                for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            }
        if qk_norm:
            out |= {p + "self_attn.q_norm.weight": r(head_dim), p + "self_attn.k_norm.weight": r(head_dim)}
    return out


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _to_gguf(hf: dict[str, np.ndarray], permute_heads: dict[str, int] | None) -> dict[str, np.ndarray]:
    """Rename (and for llama, permute) as llama.cpp's converter does."""
    out = {}
    for name, t in hf.items():
        if name.startswith("model.layers."):
            _, _, i, *mid, kind = name.split(".")
            piece = GGUF_NAMES[".".join(mid)]
            if permute_heads and piece in permute_heads:
                t = llama_cpp_permute(t, permute_heads[piece])
            out[f"blk.{i}.{piece}.{kind}"] = t
        else:
            out[
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name]
            ] = t
    return out


def _check_round_trip(src, hf):
    got = dict(src.weights())
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert torch.equal(got[name], torch.from_numpy(t)), name
    return _load_into_heron_model(src.hf_config, src.weights())


def test_llama_round_trip_through_llama_cpp_permutation(tmp_path):
    dims = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=2)
    hf = _hf_tensors(
        head_dim=8, untied=True, bias=True, **{k: dims[k] for k in ("hidden", "heads", "kv_heads", "ffn", "layers")}
    )
    path = _write(
        tmp_path / "tiny-llama.gguf",
        "llama",
        _to_gguf(hf, {"attn_q": 4, "attn_k": 2}),
        extra=lambda w: (w.add_eot_token_id(3), w.add_sampling_temp(0.6), w.add_sampling_top_p(0.9)),
        **dims,
    )
    src = load_gguf(path)
    cfg = _check_round_trip(src, hf)  # q/k weights and biases back in Hugging Face order
    assert src.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert src.hf_config["tie_word_embeddings"] is False and "lm_head.weight" in dict(src.weights())
    assert src.hf_config["attention_bias"] is True and cfg.attention_bias
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.max_position_embeddings) == (8, 2, 500000.0, 256)
    assert src.name == "tiny-llama"
    # an end-of-turn token besides eos ends generation too; sampling defaults come along
    assert src.generation_config == {"bos_token_id": 1, "eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.9}
    assert cfg.eos_token_ids == (2, 3)
    tok = src.tokenizer
    assert tok.chat_template == TEMPLATE and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.convert_ids_to_tokens(tok("hello")["input_ids"]) == ["hello"]


def test_qwen2_is_not_permuted_and_counts_vocab_from_tokens(tmp_path):
    dims = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=2)
    hf = _hf_tensors(head_dim=8, bias=True, **dims)
    path = _write(tmp_path / "q2.gguf", "qwen2", _to_gguf(hf, None), vocab_size=False, **dims)
    src = load_gguf(path)
    cfg = _check_round_trip(src, hf)
    assert src.hf_config["architectures"] == ["Qwen2ForCausalLM"] and cfg.attention_bias
    assert src.hf_config["vocab_size"] == len(TOKENS) and cfg.tie_word_embeddings


def test_qwen3_head_dim_from_key_length_and_qk_norm(tmp_path):
    dims = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=1)
    hf = _hf_tensors(head_dim=16, qk_norm=True, **dims)  # head_dim != hidden / heads, as in Qwen3
    path = _write(
        tmp_path / "q3.gguf",
        "qwen3",
        _to_gguf(hf, None),
        extra=lambda w: (w.add_key_length(16), w.add_value_length(16)),
        **dims,
    )
    src = load_gguf(path)
    cfg = _check_round_trip(src, hf)
    assert src.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.head_dim == 16 and cfg.qk_norm and not cfg.attention_bias


def test_unsupported_architecture(tmp_path):
    dims = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=1)
    path = _write(tmp_path / "falcon.gguf", "falcon", _to_gguf(_hf_tensors(head_dim=8, **dims), None), **dims)
    with pytest.raises(ValueError, match=r"'falcon'.*supported: llama, qwen2, qwen3, qwen2moe"):
        load_gguf(path)


def test_linear_rope_scaling(tmp_path):
    dims = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=1)
    path = _write(
        tmp_path / "lin.gguf",
        "llama",
        _to_gguf(_hf_tensors(head_dim=8, **dims), {"attn_q": 4, "attn_k": 2}),
        extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(4.0)),
        **dims,
    )
    cfg = TransformerConfig.from_hf(load_gguf(path).hf_config)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def llama_cpp_rope_freqs(head_dim, theta, factor, low, high, old_len) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for a Llama 3 `rope_scaling`: per frequency, the
    number it is divided by."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            s = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(
    "factor,low,high,old_len", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 6.0, 4096)]
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor, low, high, old_len):
    dims = dict(hidden=128, heads=2, kv_heads=1, ffn=16, layers=1)  # head_dim 64: several blended frequencies
    tensors = _to_gguf(_hf_tensors(head_dim=64, **dims), {"attn_q": 2, "attn_k": 1})
    tensors["rope_freqs.weight"] = llama_cpp_rope_freqs(64, 500000.0, factor, low, high, old_len)
    src = load_gguf(_write(tmp_path / "l3.gguf", "llama", tensors, **dims))
    assert all(not n.startswith("rope") for n, _ in src.weights())
    cfg = TransformerConfig.from_hf(src.hf_config)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == factor
    expected = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_len,
    }
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, cfg.rope_scaling), rope_inv_freq(64, 500000.0, expected))
    if (low, high, old_len) == (1.0, 4.0, 8192):  # the usual values come back as such
        assert cfg.rope_scaling == expected
