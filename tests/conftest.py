"""Shared fixtures: the embedded model's tokenizer and small random-weight checkpoints in Hugging Face
folders (Llama, Qwen2, Qwen3, Phi-3, Mistral, Gemma 2 / 3; the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE), made once per test session. Nothing is downloaded."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from heron.models.loader import embedded_model_path

# One torch thread in the test process and in every process it starts (servers, CLIs, the quickstart's
# commands): on a small busy CPU, OpenMP threads that wait for a descheduled sibling make each step several
# times slower (run-batch's SIGKILL/resume test on a loaded 2-core machine: 102 s with torch's default of
# two threads, 33 s with one). A test that needs another count sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A GGUF conversion cache of the session's own (heron/models/gguf_cache.py), for it and every process it starts:
# the embedded model's metadata and tokenizer are read from its file once, not at every engine start, and nothing
# is written to the user's cache.
os.environ.setdefault("HERON_CACHE_DIR", tempfile.mkdtemp(prefix="heron-test-cache-"))
atexit.register(shutil.rmtree, os.environ["HERON_CACHE_DIR"], ignore_errors=True)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer; from the folder $HERON_TEST_TOKENIZER names where it is set (a device
    machine without the embedded model's package carries the tokenizer alone: benchmarks/gpu_check.sh)."""
    from transformers import AutoTokenizer

    if folder := os.environ.get("HERON_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(folder)
    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _hf_config(arch: str, vocab_size: int, bos: int, eos: int):
    from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    common = dict(TINY, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "phi3":  # its checkpoint stores qkv_proj and gate_up_proj fused
        return Phi3Config(**common, pad_token_id=eos)
    if arch in SLIDING_WINDOW_FAMILIES:
        return sliding_window_config(arch, common)
    return Qwen3Config(**common, head_dim=32)


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _moe_hf_config(arch: str, vocab_size: int, bos: int, eos: int):
    """Tiny mixtures of experts: Mixtral 2 of 8 experts; Qwen2-MoE with layer 0 sparse (4 of 8, not
    renormalised, a shared expert) and layer 1 dense (`mlp_only_layers`); Qwen3-MoE 3 of 8, renormalised."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(TINY, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    experts = dict(num_experts=8, moe_intermediate_size=32)
    if arch == "mixtral":
        return MixtralConfig(**dict(common, intermediate_size=32), num_local_experts=8, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            **experts,
            num_experts_per_tok=4,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    return Qwen3MoeConfig(**common, **experts, head_dim=32, num_experts_per_tok=3, norm_topk_prob=True)


# Windows of a few tokens, so that the test prompts run past them; Gemma's soft caps low enough to bind on these
# weights, a head_dim other than hidden / heads, a query scale other than head_dim ** -0.5.
SLIDING_WINDOW = 8
SLIDING_WINDOW_FAMILIES = ("mistral", "gemma2", "gemma3", "phi3-longrope")


def sliding_window_config(arch: str, common: dict):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config

    if arch == "mistral":
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    gemma = dict(common, head_dim=32, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW, pad_token_id=0)
    if arch == "gemma2":  # layer 0 local, layer 1 global
        return Gemma2Config(**gemma, attn_logit_softcapping=3.0, final_logit_softcapping=2.0)
    if arch == "gemma3":  # local RoPE base 10k, global 1M with linear scaling
        return Gemma3TextConfig(
            **dict(gemma, tie_word_embeddings=True),
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        )
    # Phi-3.5's LongRoPE with a 32-token original context (long factors past it), and Phi-3-4k's window
    short, long = [1.0 + i / 8 for i in range(8)], [2.0 + i for i in range(8)]
    rope = dict(rope_type="longrope", short_factor=short, long_factor=long)
    return Phi3Config(
        **common, pad_token_id=0, original_max_position_embeddings=32, rope_scaling=rope, sliding_window=SLIDING_WINDOW
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    """`tiny_model_dir(arch)` -> a folder with config.json, model.safetensors and the tokenizer."""
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(arch: str = "llama") -> str:
        if arch not in made:
            torch.manual_seed(0)
            tok = embedded_tokenizer
            hf_config = _moe_hf_config if arch in MOE_ARCHS else _hf_config
            cfg = hf_config(arch, len(tok), tok.bos_token_id, tok.eos_token_id)
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
            with torch.no_grad():  # wider weights than the default init, so that logits are not flat
                for p in model.parameters():
                    if p.dim() > 1 or arch.startswith("gemma"):  # (Gemma's norms: w of 1 + w, zeros at init)
                        p.normal_(0, 0.1)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tok.save_pretrained(path)
            made[arch] = str(path)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def embedded_llm():
    """One engine on the embedded model for the whole session (loading costs seconds)."""
    from heron import LLM

    return LLM(kv_cache_memory=512 << 20)


@pytest.fixture
def spawn_ranks(tmp_path, monkeypatch):
    """`spawn_ranks(fn, *args)` runs fn(rank, world_size, init_method, *args) in two processes that
    meet over gloo through a file in tmp_path; fn (module-level, so that it pickles) joins with
    `init_distributed`. An exception in any rank fails the test with that rank's traceback."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on a 2-core machine
    calls = iter(range(1 << 30))

    def spawn(fn, *args, world_size: int = 2) -> None:
        init_method = f"file://{tmp_path / f'dist-init-{next(calls)}'}"  # a store file serves one group
        mp.spawn(fn, args=(world_size, init_method, *args), nprocs=world_size, join=True)

    return spawn
