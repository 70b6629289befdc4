"""Physical limits, measured in the same run as the figure they bound.

Two machine rates (copy bandwidth, matmul rate) and the work a workload must do on a model (bytes that
must move, FLOPs that must be computed) give a lower bound on time: max(bytes / bandwidth, FLOPs / rate).
The byte count is what any engine has to read, not what Heron happens to read:
  - weights: once per step, and there are at least max(longest output, total output / batch) steps;
    the input embedding is a row lookup, so it is not counted unless tied to the LM head (which is read);
  - KV cache: a decoding token reads the K and V of its whole context once (random prompts share nothing).
FLOPs: 2 per weight per token through the layers, 2 per LM-head weight per sampled token, and 4 x heads x
head_dim per (query, key) pair of causal attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from heron.models.config import TransformerConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes per second of a large same-device copy, counting bytes read plus bytes written (the
    convention of ANCHORS.md: 4.26 TB/s on the H200 with a 1 GiB buffer, larger than any cache)."""
    nbytes = nbytes or 1 << 30
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 3) -> float:
    """FLOP/s of an n^3 matmul in `dtype` (random data): 8192 on a GPU, 2048 on a CPU."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_time(lambda: a @ b, device, reps)
    return 2 * n**3 / seconds


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model, from its shape and the engine's dtype."""

    layer_params: int  # matmul weights in the decoder layers
    lm_head_params: int
    decode_weight_bytes: int  # read by every step: all weights but an untied input embedding
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # one (query, key) pair of attention over all layers

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: TransformerConfig, dtype: torch.dtype) -> ModelCost:
        embed = model.embed_tokens.weight
        tied = model.lm_head.weight is embed
        params = {id(p): p for p in model.parameters()}  # tied parameters once
        weight_bytes = sum(p.numel() * p.element_size() for p in params.values() if tied or p is not embed)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        return cls(
            layer_params=cfg.num_layers * per_layer,
            lm_head_params=cfg.vocab_size * cfg.hidden_size,
            decode_weight_bytes=weight_bytes,
            kv_bytes_per_token=2 * cfg.num_layers * kv * dtype.itemsize,
            attn_flops_per_pair=4 * cfg.num_layers * q,
        )


@dataclass(frozen=True)
class WorkloadBound:
    min_seconds: float
    bound_by: str  # "memory" or "compute"
    bytes_moved: float
    flops: float


def workload_bound(
    cost: ModelCost, lengths: list[tuple[int, int]], batch_size: int, bandwidth: float, flop_rate: float
) -> WorkloadBound:
    """Lower bound on the time to serve requests of (prompt, output) lengths at most `batch_size` at once."""
    total_out = sum(o for _, o in lengths)
    steps = max(max(o for _, o in lengths), -(-total_out // batch_size))
    # The first output token comes from the prompt pass; output token j = 1 .. o - 1 is fed back and
    # attends to p + j keys.
    kv_reads = sum((o - 1) * p + (o - 1) * o // 2 for p, o in lengths)
    bytes_moved = steps * cost.decode_weight_bytes + kv_reads * cost.kv_bytes_per_token
    tokens = sum(p + o - 1 for p, o in lengths)  # every prompt token and every fed-back output token
    pairs = sum(n * (n + 1) // 2 for n in (p + o - 1 for p, o in lengths))  # causal (query, key) pairs
    flops = 2 * cost.layer_params * tokens + 2 * cost.lm_head_params * total_out + cost.attn_flops_per_pair * pairs
    t_mem, t_flop = bytes_moved / bandwidth, flops / flop_rate
    return WorkloadBound(max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute", bytes_moved, flops)


def prefill_flops(cost: ModelCost, prompt_lens: list[int]) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) of computing whole prompts and sampling one token after each.
    Every prompt token goes through the layers' weights, but only a prompt's last token through the LM
    head: the engine computes logits only where it samples, so counting the head per token would credit
    it with work it never does. Attention's FLOPs (growing with the prompt's square) are returned apart, so
    that a utilisation of the weights' matmuls can leave them out."""
    matmul = 2 * cost.layer_params * sum(prompt_lens) + 2 * cost.lm_head_params * len(prompt_lens)
    attention = cost.attn_flops_per_pair * sum(n * (n + 1) // 2 for n in prompt_lens)  # causal (query, key) pairs
    return matmul, attention
