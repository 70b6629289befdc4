"""Llama, Qwen3 and Qwen2-MoE (its experts split by their intermediate dim, a shared expert) split over two gloo
ranks give the logits of the whole model (float32), through a prefill batch and a decode step over each rank's
half of the KV cache; head counts that do not divide are refused with a message that names them."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from heron.attention import AttentionMetadata
from heron.attention.torch_ref import TorchAttentionBackend
from heron.distributed import destroy_distributed, get_tp_world_size, init_distributed, parallel_state
from heron.models.config import TransformerConfig
from heron.models.registry import get_model_cls

BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 8


def _checkpoint(path: str, tied: bool, vocab_size: int) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    """The tiny checkpoint, optionally cut to `vocab_size` rows and with the LM head tied to the embedding."""
    cfg = TransformerConfig.from_hf(json.load(open(os.path.join(path, "config.json"))))
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:vocab_size]
    if tied:
        del weights["lm_head.weight"]
    return dataclasses.replace(cfg, vocab_size=vocab_size, tie_word_embeddings=tied), weights


def _metadata(prompts: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and metadata for the tokens of each prompt from `starts[i]` on; sequence i
    owns blocks i*BLOCKS_PER_SEQ onwards."""
    new = [list(range(s, len(p))) for p, s in zip(prompts, starts)]
    ids = torch.tensor([p[j] for p, js in zip(prompts, new) for j in js])
    positions = torch.tensor([j for js in new for j in js])
    slots = torch.tensor([i * BLOCKS_PER_SEQ * BLOCK_SIZE + j for i, js in enumerate(new) for j in js])
    qsl = torch.tensor([0, *torch.tensor([len(js) for js in new]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    tables = torch.arange(len(prompts) * BLOCKS_PER_SEQ, dtype=torch.int32).view(len(prompts), -1)
    meta = AttentionMetadata(
        num_seqs=len(prompts),
        num_tokens=len(ids),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=max(map(len, new)),
        max_seq_len=max(map(len, prompts)),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return ids, positions, meta


@torch.inference_mode()
def _logits(path: str, tied: bool, vocab_size: int) -> torch.Tensor:
    """This rank's model (built as the model runner builds it) on a prefill batch of three prompts, then
    one decode step: the last-token logits of both steps, [2, 3, vocab]."""
    cfg, weights = _checkpoint(path, tied, vocab_size)
    heads, kv_heads = cfg.heads_per_rank(get_tp_world_size())
    model = get_model_cls(cfg.architecture)(
        cfg, TorchAttentionBackend(heads, kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    )
    model.load_weights(weights.items())
    for layer in model.layers:
        layer.self_attn.kv_cache = torch.zeros(2, 3 * BLOCKS_PER_SEQ, BLOCK_SIZE, kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 2)]
    out = []
    for starts in ([0, 0, 0], [len(p) for p in prompts]):
        ids, positions, meta = _metadata(prompts, starts)
        logits = model.compute_logits(model(ids, positions, meta)[meta.query_start_loc[1:].long() - 1])
        out.append(logits)
        prompts = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1))]
    return torch.stack(out)


def _tp_logits(
    rank: int, world_size: int, init_method: str, path: str, tied: bool, vocab_size: int, expected: torch.Tensor
) -> None:
    init_distributed(rank, world_size, init_method, "gloo")
    try:
        torch.testing.assert_close(_logits(path, tied, vocab_size), expected, rtol=1e-5, atol=1e-5)
    finally:
        destroy_distributed()


@pytest.mark.parametrize(
    "arch, tied, vocab_size",
    [("llama", False, 49152), ("qwen3", True, 49151), ("qwen2_moe", False, 49152)],
    ids=["llama", "qwen3-tied-odd-vocab", "qwen2_moe"],
)
def test_two_ranks_give_the_logits_of_one(arch, tied, vocab_size, tiny_model_dir, spawn_ranks):
    path = tiny_model_dir(arch)
    expected = _logits(path, tied, vocab_size)
    assert expected.shape == (2, 3, vocab_size)
    spawn_ranks(_tp_logits, path, tied, vocab_size, expected)


def test_heads_per_rank_splits_heads_and_refuses_what_does_not_divide(tiny_model_dir):
    cfg, _ = _checkpoint(tiny_model_dir("llama"), False, 49152)  # 4 heads, 2 KV heads
    assert cfg.heads_per_rank(1) == (4, 2) and cfg.heads_per_rank(2) == (2, 1)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        cfg.heads_per_rank(3)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        cfg.heads_per_rank(4)


def test_a_rank_builds_its_share_of_each_layer_and_refuses_kv_heads_that_do_not_divide(monkeypatch, tiny_model_dir):
    cfg, _ = _checkpoint(tiny_model_dir("qwen3"), False, 49151)  # hidden 64, 4 heads and 2 KV heads of 32
    build = lambda c: get_model_cls(c.architecture)(c, TorchAttentionBackend(1, 1, c.head_dim, 1.0))
    monkeypatch.setattr(parallel_state, "_world_size", 2)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in build(cfg).named_parameters()}
        assert shapes["layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * 32, 64)
        assert shapes["layers.0.self_attn.o_proj.weight"] == (64, 2 * 32)
        assert shapes["layers.0.mlp.gate_up_proj.weight"] == (128, 64)
        assert shapes["layers.0.mlp.down_proj.weight"] == (64, 64)
        assert shapes["embed_tokens.weight"] == shapes["lm_head.weight"] == (24576, 64)  # 49151 padded to 49152
        with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tensor_parallel_size=2"):
            build(dataclasses.replace(cfg, num_kv_heads=1))
