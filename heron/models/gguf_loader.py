"""A GGUF file (llama.cpp's format) as a `ModelSource`: an HF-style config.json dict built from the
metadata, the tensors dequantized to float32 under their Hugging Face names and layouts, and the
tokenizer transformers builds from the file.

What llama.cpp's converter does differently per family (names, metadata, norm offsets, stacked experts) is
described in `gguf_families.py`; two llama changes are undone here:

* For the `llama` architecture it reorders the rows of every q_proj and k_proj head from the
  rotate-half RoPE layout of Hugging Face checkpoints to interleaved pairs (llama.cpp rotates
  adjacent elements). `_unpermute_rope_rows` puts them back. Qwen2/Qwen3 use the rotate-half layout in
  llama.cpp too and are stored unpermuted.
* Llama 3.x's RoPE scaling is not written as metadata but as a `rope_freqs.weight` tensor of per-frequency
  divisors; `_llama3_rope_scaling` recovers the equivalent `rope_scaling` dict.

Reading the metadata and building the tokenizer take seconds (gguf_cache.py says why); the first load of a file
keeps their results in gguf_cache, and later loads of the same file take them from there and read only the
tensors' bytes from the file (where each tensor lies: `TensorRef`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from heron.config import ModelSource
from heron.layers.rotary import rope_inv_freq
from heron.models import gguf_cache
from heron.models.gguf_families import FAMILIES, GGUFFamily

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<piece>.<weight|bias> -> model.layers.N.<HF piece>.<weight|bias>
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# All experts of a block in one tensor [E, rows, cols] -> one Hugging Face matrix per expert.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that only feed the config, never a parameter.
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


class TensorRef(NamedTuple):
    """One tensor of a GGUF file as GGUFReader maps it: its name, ggml type, and its raw array's byte offset in
    the file, numpy dtype and shape (blocks of bytes for a quantized type)."""

    name: str
    qtype: int
    offset: int
    dtype: str
    shape: list[int]

    def data(self, file: np.ndarray) -> np.ndarray:
        """The raw array in `file`, the whole file as a read-only uint8 memmap."""
        dtype = np.dtype(self.dtype)
        size = math.prod(self.shape) * dtype.itemsize
        return file[self.offset : self.offset + size].view(dtype).reshape(self.shape)


def load_gguf(path: str) -> ModelSource:
    """Read a GGUF file of a supported architecture (`gguf_families.FAMILIES`). Raises ValueError for an
    unreadable file or an unsupported architecture."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist.")
    cached = gguf_cache.load(path)
    if cached is None:
        contents, tokenizer = _convert(path)
        contents = json.loads(json.dumps(contents))  # as a cached load sees it (lists, not tuples)
        gguf_cache.store(path, contents, tokenizer)
    else:
        contents, tokenizer = cached
    return ModelSource(
        name=os.path.basename(path).removesuffix(".gguf"),
        hf_config=contents["hf_config"],
        weights=lambda: _weights(path, contents),
        tokenizer=tokenizer,
        generation_config=contents["generation_config"],
    )


def _convert(path: str) -> tuple[dict, object]:
    """Parse the file: (contents, tokenizer), contents being what gguf_cache keeps (the architecture, the
    config, the generation defaults and each tensor's `TensorRef`)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated, not GGUF at all, corrupt header: numpy/struct errors of all kinds
        raise ValueError(f"GGUF file {path} is corrupt or unreadable: {type(e).__name__}: {e}") from e

    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise ValueError(
            f"GGUF file {path} has architecture {arch!r}, which is not supported (supported: {', '.join(FAMILIES)})."
        )
    family = FAMILIES[arch]
    tensors = {t.name: t for t in reader.tensors}
    if family.permute_qk and any(".ffn_gate_exps." in n for n in tensors):
        raise ValueError(
            f"GGUF file {path} is a Mixtral (llama with experts), which Heron reads from its Hugging Face "
            "checkpoint only (transformers does not read these files either)."
        )
    names = {name: _hf_name(name, family) for name in tensors}
    if unknown := sorted(n for n, hf in names.items() if hf is None and n not in _CONFIG_TENSORS):
        raise ValueError(f"GGUF file {path} holds tensors with no Hugging Face counterpart: {unknown[:5]}")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} has no token_embd.weight tensor.")

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return _dequantize(path, name, t.data, t.tensor_type)

    hf_config = _hf_config(path, arch, meta, tensors, read)
    generation_config = {
        k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None
    }
    # Recent converters copy generation_config.json's sampling defaults into the file.
    for gguf_key, hf_key in _SAMPLING_KEYS.items():
        if (value := meta.get(gguf_key)) is not None:
            generation_config[hf_key] = value
    refs = [
        TensorRef(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str, list(t.data.shape))
        for t in reader.tensors
    ]
    contents = {"arch": arch, "hf_config": hf_config, "generation_config": generation_config, "tensors": refs}
    return contents, _tokenizer(path, meta)


def _dequantize(path: str, name: str, data: np.ndarray, qtype) -> np.ndarray:
    """A tensor's raw array as float32 (a writable copy where it would be a view of the read-only map)."""
    import gguf

    try:
        w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype))
    except Exception as e:
        raise ValueError(
            f"GGUF file {path}: cannot dequantize {name} ({gguf.GGMLQuantizationType(qtype).name}): {e}"
        ) from e
    w = w.astype(np.float32, copy=False)
    return w if w.flags.writeable else np.array(w)  # F32 tensors come back as views of the read-only mmap


def _weights(path: str, contents: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, dequantized, under their Hugging Face names and in their layouts."""
    family = FAMILIES[contents["arch"]]
    hf_config = contents["hf_config"]
    # Rows of each q/k head to reorder: only llama's converter permutes them.
    rope_heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    rope_heads = rope_heads if family.permute_qk else {}
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for ref in map(TensorRef._make, contents["tensors"]):
        hf = _hf_name(ref.name, family)
        if hf is None:
            continue
        w = torch.from_numpy(_dequantize(path, ref.name, ref.data(file), ref.qtype))
        piece = ref.name.split(".")[2] if ref.name.startswith("blk.") else None
        if piece in rope_heads:
            w = _unpermute_rope_rows(w, rope_heads[piece])
        if family.norm_offset and ref.name.endswith("norm.weight"):
            w -= family.norm_offset
        if piece in _EXPERT_TENSORS:
            layer = ref.name.split(".")[1]
            for e, matrix in enumerate(w):
                yield f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_TENSORS[piece]}.weight", matrix
        elif piece == "ffn_gate_inp_shexp" and w.dim() == 1:  # stored [H]; the module's weight is [1, H]
            yield hf, w[None]
        else:
            yield hf, w


class _Metadata:
    """GGUF key/value metadata as plain Python values, read on demand (the token list alone has tens
    of thousands of entries)."""

    def __init__(self, reader) -> None:
        import gguf

        self._fields = reader.fields
        self._types = gguf.GGUFValueType

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def length(self, key: str) -> int | None:
        f = self._fields.get(key)
        return None if f is None else len(f.data)

    def get(self, key: str, default=None):
        f = self._fields.get(key)
        if f is None or not f.types:
            return default
        T = self._types
        if f.types[0] == T.ARRAY:
            if len(f.types) > 2:  # arrays of arrays: nothing the config needs
                return default
            return [self._scalar(f.parts[i], f.types[1]) for i in f.data]
        return self._scalar(f.parts[f.data[0]], f.types[0])

    def _scalar(self, part: np.ndarray, vtype):
        if vtype == self._types.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        if vtype == self._types.FLOAT32:
            # The shortest decimal that is the same float32: 1e-05, not 9.999999747378752e-06.
            value = float(str(np.float32(value)))
        return value


def _hf_name(gguf_name: str, family: GGUFFamily) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    piece = m.group(2)
    if piece in _EXPERT_TENSORS:  # one name per expert, given when the tensor is split
        return f"model.layers.{m.group(1)}.mlp.experts"
    module = family.tensors.get(piece) or _BLOCK_TENSORS.get(piece)
    return None if module is None else f"model.layers.{m.group(1)}.{module}.{m.group(3)}"


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Within each head of d rows the converter moved Hugging Face row
    j*d/2 + i (i < d/2, j in {0, 1}: the two halves that rotate-half pairs up) to row 2*i + j, so that
    the pairs sit next to each other. Viewing each head as [d/2, 2] and transposing to [2, d/2] reads the
    rows back in their original order. Works for weights [rows, in] and biases [rows] alike."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of an even size.")
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_config(path: str, arch: str, meta: _Metadata, tensors: dict, read) -> dict:
    def key(name: str, default=None, required: bool = False, per_layer: bool = False):
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch}.{name}.")
        if isinstance(value, list) and not per_layer:  # per-layer values: only uniform ones are supported
            if len(set(value)) != 1:
                raise ValueError(f"GGUF file {path}: {arch}.{name} varies by layer ({value[:8]}...); not supported.")
            value = value[0]
        return value

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    kv_heads = key("attention.head_count_kv") or heads
    # GGUF shapes are listed innermost first: token_embd is [hidden, vocab].
    embed_rows = int(tensors["token_embd.weight"].shape[-1])
    vocab = key("vocab_size") or meta.length("tokenizer.ggml.tokens") or embed_rows
    if vocab != embed_rows:
        raise ValueError(f"GGUF file {path}: vocab size {vocab} does not match token_embd.weight ({embed_rows} rows).")
    head_dim = key("attention.key_length")
    if head_dim is None and "blk.0.attn_q.weight" in tensors:
        head_dim = int(tensors["blk.0.attn_q.weight"].shape[-1]) // heads
    head_dim = head_dim or hidden // heads

    family = FAMILIES[arch]
    config = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": family.hidden_act,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    if (scaling := _rope_scaling(path, arch, meta, tensors, config)) is not None:
        config["rope_scaling"] = scaling
    if family.config is not None:
        config |= {k: v for k, v in family.config(arch, key, tensors, read).items() if v is not None}

    bos = meta.get("tokenizer.ggml.bos_token_id")
    # Chat models often end a turn with a token other than eos (Llama 3's <|eot_id|>, <|eom_id|>).
    eos = [t for t in (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if t is not None]
    eos = list(dict.fromkeys(eos))
    config["bos_token_id"] = bos
    config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        config["pad_token_id"] = pad
    return config


def _rope_scaling(path: str, arch: str, meta: _Metadata, tensors: dict, config: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling = {"rope_type": kind, "factor": float(factor)}
        if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = orig
        return scaling
    if kind not in (None, "none", "linear", "yarn"):
        return {"rope_type": kind}  # passed on for TransformerConfig to refuse with a clear message
    if "rope_freqs.weight" in tensors:
        import gguf

        t = tensors["rope_freqs.weight"]
        divisors = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64))
        return _llama3_rope_scaling(path, divisors.flatten(), config["head_dim"], config["rope_theta"])
    return None


def _llama3_rope_scaling(path: str, divisors: torch.Tensor, head_dim: int, theta: float) -> dict | None:
    """Recover Llama 3's `rope_scaling` from llama.cpp's per-frequency divisors. Llama 3 leaves frequencies
    with a wavelength under original/high_freq_factor alone, divides those over original/low_freq_factor
    by `factor`, and in between blends with a weight s that is linear in the frequency:
    1/divisor = (1 - s)/factor + s. Only the two wavelength thresholds matter, so with low_freq_factor
    fixed at 1 a straight line through the blended points gives the rest. The result is checked by
    recomputing the divisors with the engine's own RoPE code."""
    if divisors.numel() != head_dim // 2:
        raise ValueError(
            f"GGUF file {path}: rope_freqs.weight has {divisors.numel()} entries, expected {head_dim // 2}."
        )
    if torch.allclose(divisors, torch.ones_like(divisors)):
        return None
    factor = float(divisors.max())
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    candidates = [{"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}]
    blended = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if int(blended.sum()) >= 2:
        s = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freq[blended].numpy(), s.numpy(), 1)  # s = a*freq + b
        if a > 0 and b < 0:
            high = 1 - 1 / b
            candidates.append(
                {
                    "low_freq_factor": 1.0,
                    "high_freq_factor": float(high),
                    "original_max_position_embeddings": float(2 * np.pi * a * (high - 1)),
                }
            )
    base = rope_inv_freq(head_dim, theta, None).double()
    for c in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, **c}
        if torch.allclose(base / rope_inv_freq(head_dim, theta, scaling).double(), divisors, rtol=1e-3):
            return scaling
    raise ValueError(
        f"GGUF file {path}: rope_freqs.weight does not follow Llama 3 RoPE scaling; such files are not supported."
    )


def _tokenizer(path: str, meta: _Metadata):
    # PreTrainedTokenizerFast rather than AutoTokenizer: the same tokenizer (the GGUF conversion builds
    # the backend either way), but AutoTokenizer first parses the whole file once more just to pick a class
    # from the config, which costs seconds for a 49k-token vocabulary.
    from transformers import PreTrainedTokenizerFast

    folder, filename = os.path.split(os.path.abspath(path))
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=filename)
    except Exception as e:
        raise ValueError(f"GGUF file {path}: transformers cannot build its tokenizer ({type(e).__name__}: {e}).") from e
    template = meta.get("tokenizer.chat_template")
    if template and tok.chat_template != template:
        tok.chat_template = template
    # Make the special tokens the file names win over whatever the conversion guessed.
    for attr, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = meta.get(key)
        if token_id is not None and 0 <= token_id < len(tok) and getattr(tok, f"{attr}_id") != token_id:
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    return tok
