"""`kv_cache_dtype="fp8"` end to end on the CPU (the torch reference backend) with a tiny random Llama: the pool
holds 4x the blocks of the float32 model's cache in the same memory, greedy outputs agree with the float32
cache's, swapped-out and prefix-cached float8 blocks come back as they left, and a checkpoint's KV scales load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron import LLM, SamplingParams
from heron.inputs import TokensPrompt

ENGINE = dict(
    dtype="float32", device="cpu", kv_cache_memory=4 << 20, max_model_len=256, max_num_seqs=4, swap_space=1 / 1024
)
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    system = rng.integers(100, 5000, 32).tolist()  # shared: the second round hits the prefix cache
    return [TokensPrompt(prompt_token_ids=system + rng.integers(100, 5000, 5 + 7 * i).tolist()) for i in range(4)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, prompts):
    """Per kv_cache_dtype: (blocks in the pool, the pool's dtype, greedy token ids, the same prompts again, the
    engine's model runner)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    out = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_model_dir("llama"), kv_cache_dtype=kv, **ENGINE)
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        out[kv] = (llm.engine.block_manager.num_blocks, llm.engine.runner.kv_cache.dtype, ids, again, llm.engine.runner)
    return out


def test_pool_holds_four_times_the_blocks_of_a_float32_cache(runs):
    assert runs["fp8"][1] == torch.float8_e4m3fn and runs["auto"][1] == torch.float32
    assert runs["fp8"][0] == 4 * runs["auto"][0]


def test_greedy_outputs_agree_with_the_float32_cache(runs):
    auto, fp8 = runs["auto"][2], runs["fp8"][2]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NUM_TOKENS) for x, y in zip(auto, fp8)]
    # Measured: 9, 16, 2 and 22 of 24. A random model's logits are nearly flat (a hard case: one rounding flips
    # the top token) and its K and V small (std ~0.16, some 8% below e4m3's smallest normal 2**-6 at the
    # uncalibrated scale 1.0). The embedded SmolLM2 (not run here: minutes on a shared CPU) agreed for 26, 13, 32
    # and 3 of 32 tokens.
    assert min(agree) >= 2 and sum(agree) >= 0.4 * NUM_TOKENS * len(agree), agree


def test_prefix_cached_fp8_blocks_give_the_same_tokens(runs):
    assert runs["fp8"][3] == runs["fp8"][2]


def test_fp8_blocks_swap_out_and_in_as_bytes(runs):
    runner = runs["fp8"][4]
    kv = runner.kv_cache.view(torch.uint8)
    assert runner.cpu_kv_cache.dtype == torch.float8_e4m3fn and kv[:, :, :2].any()  # the runs wrote blocks 0, 1
    before = kv[:, :, :2].clone()
    runner.move_blocks(swap_out=[(0, 1), (1, 0)], swap_in=[], copies=[])
    runner.move_blocks(swap_out=[], swap_in=[(0, 7), (1, 6)], copies=[(6, 8)])
    assert torch.equal(kv[:, :, [6, 7, 8]], before[:, :, [0, 1, 0]])


def test_checkpoint_kv_scales_are_loaded_and_written_with(runs, tiny_model_dir, prompts, tmp_path):
    """A checkpoint's per-tensor k_scale / v_scale (compressed-tensors' names) reach each layer, and the cache write
    divides by them: layer 0's cached K and V of the first block (from the embeddings alone, so the same in every
    engine) times the scales are the float32 engine's to e4m3's precision."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "scaled")
    tensors = load_file(folder / "model.safetensors")
    scales = {"k_scale": 0.05, "v_scale": 0.07}
    for i in range(2):
        tensors.update({f"model.layers.{i}.self_attn.{n}": torch.tensor(v) for n, v in scales.items()})
    save_file(tensors, folder / "model.safetensors")
    llm = LLM(str(folder), kv_cache_dtype="fp8", **ENGINE)
    params = llm.engine.runner.model.layers[1].self_attn.attn_params
    assert (params.k_scale, params.v_scale) == pytest.approx((0.05, 0.07))  # (float32 in the checkpoint)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    got = llm.engine.runner.kv_cache[0, :, 0].float() * torch.tensor([0.05, 0.07]).view(2, 1, 1, 1)
    want = runs["auto"][4].kv_cache[0, :, 0]
    assert want.abs().max() > 0 and ((got - want).abs() <= want.abs() * 2**-4 + 2**-9 * 0.07).all()


def test_fp8_refuses_flashinfer():
    from heron.config import CacheConfig, EngineConfig

    with pytest.raises(ValueError, match="flashinfer"):
        EngineConfig(cache=CacheConfig(kv_cache_dtype="fp8"), attention_backend="flashinfer").verify()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype="int8").verify()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_cache_in_cuda_graphs_matches_eager(tiny_model_dir, prompts):
    """On the GPU (the rotary kernel's float8 write, the Triton kernels' reads): decode steps replayed from CUDA
    graphs captured over a float8 pool give the eager steps' greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(
            tiny_model_dir("qwen3"), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8", enforce_eager=eager,
            kv_cache_memory=16 << 20, max_model_len=256, max_num_seqs=4,
        )  # fmt: skip
        assert eager or llm.engine.runner.graphs  # captured
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]
