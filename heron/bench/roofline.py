"""Physical limits, measured in the same run as the figure they bound.

Two machine rates (copy bandwidth, matmul rate) and the work a workload must do on a model (bytes that
must move, FLOPs that must be computed) give a lower bound on time: max(bytes / bandwidth, FLOPs / rate).
The byte count is what any engine has to read, not what Heron happens to read:
  - weights: once per step, and there are at least max(longest output, total output / batch) steps;
    the input embedding is a row lookup, so it is not counted unless tied to the LM head (which is read);
    of a mixture of experts' routed experts, only those a step's tokens pick: under uniform routing (each
    token k of E experts) a step of b tokens touches E (1 - (1 - k/E)^b) of each layer's experts on average
    (`ModelCost.weight_bytes_read`: the least over how an engine can spread the tokens over its steps);
  - KV cache: a decoding token reads the K and V of its whole context once, but a prompt prefix shared by a
    group of requests (`shared`) once per step for the whole group, for at least as many steps as the group's
    longest output (and it is computed once: prefix caching).
FLOPs: 2 per weight a token goes through in the layers (a mixture: its router, its k experts, a shared
expert), 2 per LM-head weight per sampled token, and 4 x heads x head_dim per (query, key) pair of causal
attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from heron.layers.moe import FusedMoE
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

    layer_params: int  # matmul weights a token goes through in the decoder layers
    lm_head_params: int
    decode_weight_bytes: int  # all weights but an untied input embedding (a dense model's step reads them all)
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # one (query, key) pair of attention over all layers
    expert_bytes: int = 0  # of decode_weight_bytes, the routed experts' (a step reads those its tokens pick)
    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: TransformerConfig, kv_dtype: torch.dtype) -> ModelCost:
        """`kv_dtype`: the paged KV cache's (the model's, or float8 with --kv-cache-dtype fp8)."""
        embed = model.embed_tokens.weight
        tied = model.lm_head.weight is embed
        params = {id(p): p for p in model.parameters()}  # tied parameters once
        weight_bytes = sum(p.numel() * p.element_size() for p in params.values() if tied or p is not embed)
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
        return cls(
            layer_params=cfg.num_layers * attention + sum(_mlp_params(cfg, i) for i in range(cfg.num_layers)),
            lm_head_params=cfg.vocab_size * cfg.hidden_size,
            decode_weight_bytes=weight_bytes,
            kv_bytes_per_token=2 * cfg.num_layers * kv * kv_dtype.itemsize,
            attn_flops_per_pair=4 * cfg.num_layers * q,
            expert_bytes=expert_bytes,
            num_experts=cfg.moe.num_experts if experts else 0,
            experts_per_token=cfg.moe.top_k if experts else 0,
        )

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a decode step of `tokens` tokens reads: every weight but the routed experts, and of
        those the expected share its tokens touch under uniform routing (an expert is missed by one token with
        probability 1 - k/E, by all of them with that to the power `tokens`)."""
        if not self.expert_bytes:
            return self.decode_weight_bytes
        missed = (1 - self.experts_per_token / self.num_experts) ** tokens
        return self.decode_weight_bytes - self.expert_bytes * missed

    def weight_bytes_read(self, outputs: list[int], batch_size: int) -> float:
        """The least weight bytes any engine reads to sample outputs[i] tokens for each request, at most
        `batch_size` tokens a step and one of a request. Every step reads the weights but the routed experts,
        and there are at least max(longest output, total / batch) steps. The experts a step touches grow
        concavely with its tokens, so the least is read with the tokens bunched into as few steps as they can
        be: the t fullest steps of any schedule hold at most F(t) = min(batch * t, sum_i min(outputs[i], t))
        tokens, and steps of F(t) - F(t - 1) tokens read the least (Karamata's inequality); an engine that
        starts every request at once, when they fit in a step, runs exactly those."""
        steps = max(max(outputs), -(-sum(outputs) // batch_size))
        if not self.expert_bytes:
            return steps * self.decode_weight_bytes
        lengths = np.sort(outputs)
        t = np.arange(1, steps + 1)
        most = np.minimum(batch_size * t, np.cumsum(len(lengths) - np.searchsorted(lengths, t)))  # F(t)
        touched = 1 - (1 - self.experts_per_token / self.num_experts) ** np.diff(most, prepend=0)
        return steps * (self.decode_weight_bytes - self.expert_bytes) + self.expert_bytes * float(touched.sum())


def _mlp_params(cfg: TransformerConfig, layer: int) -> int:
    """The matmul weights a token goes through in a layer's MLP: a dense SwiGLU, or a mixture's router, the k
    experts it picks, and a shared expert with its gate."""
    h, moe = cfg.hidden_size, cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return 3 * h * cfg.intermediate_size
    shared = moe.shared_expert_intermediate_size
    return h * moe.num_experts + 3 * h * moe.intermediate_size * moe.top_k + (3 * h * shared + h if shared else 0)


@dataclass(frozen=True)
class WorkloadBound:
    min_seconds: float
    bound_by: str  # "memory" or "compute"
    bytes_moved: float
    flops: float


def workload_bound(
    cost: ModelCost,
    lengths: list[tuple[int, int]],
    batch_size: int,
    bandwidth: float,
    flop_rate: float,
    shared: tuple[int, list[int]] | None = None,
) -> WorkloadBound:
    """Lower bound on the time to serve requests of (prompt, output) lengths at most `batch_size` at once.
    `shared` (s, group of each request): the requests of a group open with the same s prompt tokens."""
    s, group = shared or (0, [0] * len(lengths))
    longest: dict[int, int] = {}  # per group, its longest output
    for (_, o), g in zip(lengths, group):
        longest[g] = max(longest.get(g, 0), o)
    total_out = sum(o for _, o in lengths)
    # The first output token comes from the prompt pass; output token j = 1 .. o - 1 is fed back and
    # attends to p + j keys, of which a group's s shared ones are read once a step for the group.
    kv_reads = sum((o - 1) * (p - s) + (o - 1) * o // 2 for p, o in lengths) + s * sum(o - 1 for o in longest.values())
    bytes_moved = cost.weight_bytes_read([o for _, o in lengths], batch_size) + kv_reads * cost.kv_bytes_per_token
    # every prompt token (a shared prefix once a group) and every fed-back output token
    tokens = sum(p - s + o - 1 for p, o in lengths) + s * len(longest)
    tri = lambda n: n * (n + 1) // 2
    pairs = sum(tri(p + o - 1) - tri(s) for p, o in lengths) + tri(s) * len(longest)  # causal (query, key) pairs
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
