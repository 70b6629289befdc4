"""Batched sampling on tensors: penalties, logit bias, temperature, top-k / top-p / min-p, then one draw.

Randomness is counter-based: the noise for (request seed, sample index, output position, token) is a
hash of those four numbers, so a seeded request draws the same tokens whatever else shares its batch,
and no per-request generator or Python loop is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.engine.request import Sequence

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed 64-bit integer
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser: a bijection of int64 that scatters every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] uniforms in (0, 1), a pure function of (seeds[r], counters[r], v)."""
    row = _mix(_mix(seeds) + counters * _GOLDEN)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _shr(_mix(row[:, None] + v[None, :] * _GOLDEN), 11)  # 53 random bits
    return (bits.double() + 0.5) * (1.0 / (1 << 53))


@dataclass
class SamplingTensors:
    """One row per token to sample; built by the model runner."""

    temperature: torch.Tensor  # [R] float; 0 = greedy
    top_p: torch.Tensor  # [R] float
    top_k: torch.Tensor  # [R] int64; vocab size = off
    min_p: torch.Tensor  # [R] float
    seeds: torch.Tensor  # [R] int64
    counters: torch.Tensor  # [R] int64: output position and sample index, mixed
    presence_penalty: torch.Tensor | None  # [R] float, or None when no row has penalties
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    prompt_tokens: torch.Tensor | None  # [R, P] int64 padded with vocab_size (for the repetition penalty)
    output_tokens: torch.Tensor | None  # [R, O] int64 padded with vocab_size
    bias_rows: torch.Tensor | None  # logit_bias and min_tokens as sparse (row, token, value) triples
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    all_greedy: bool
    need_top_k_top_p: bool
    need_min_p: bool
    max_logprobs: int  # -1: no row wants logprobs

    @classmethod
    def build(cls, rows: list[tuple[Sequence, int, int]], vocab: int, dev: torch.device) -> SamplingTensors:
        """rows: (sequence, sample index, output position) for each token to sample."""
        params = [s.params for s, _, _ in rows]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).to(dev, non_blocking=True)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).to(dev, non_blocking=True)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        penalized = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        prompt_tokens = output_tokens = None
        if penalized:
            prompt_tokens = i64(_pad([s.token_ids[: s.num_prompt_tokens] for s, _, _ in rows], vocab))
            output_tokens = i64(_pad([s.output_token_ids for s, _, _ in rows], vocab))
        bias = []  # (row, token, value): logit_bias, and -inf on stop tokens until min_tokens are out
        for r, (s, _, pos) in enumerate(rows):
            p = s.params
            bias += [(r, tok, b) for tok, b in (p.logit_bias or {}).items() if 0 <= tok < vocab]
            if pos < p.min_tokens:
                bias += [(r, tok, float("-inf")) for tok in p.all_stop_token_ids if 0 <= tok < vocab]
        bias_cols = list(zip(*bias)) if bias else None
        return cls(
            temperature=f32([p.temperature if not p.greedy else 0.0 for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=i64(top_k),
            min_p=f32([p.min_p for p in params]),
            seeds=i64([s.request.seed for s, _, _ in rows]),
            counters=i64([(pos << 20) | idx for _, idx, pos in rows]),
            presence_penalty=f32([p.presence_penalty for p in params]) if penalized else None,
            frequency_penalty=f32([p.frequency_penalty for p in params]) if penalized else None,
            repetition_penalty=f32([p.repetition_penalty for p in params]) if penalized else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            bias_rows=i64(bias_cols[0]) if bias else None,
            bias_tokens=i64(bias_cols[1]) if bias else None,
            bias_values=f32(bias_cols[2]) if bias else None,
            all_greedy=all(p.greedy for p in params),
            need_top_k_top_p=any(k < vocab or p.top_p < 1.0 for k, p in zip(top_k, params)),
            need_min_p=any(p.min_p > 0 for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    logprob_token_ids: torch.Tensor | None  # [R, 1 + K]: the sampled token, then the top K
    logprobs: torch.Tensor | None  # [R, 1 + K]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    vocab = logits.shape[1]
    rows = logits.shape[0]
    out_counts = torch.zeros(rows, vocab + 1, device=logits.device, dtype=logits.dtype)
    out_counts.scatter_add_(1, t.output_tokens, torch.ones_like(t.output_tokens, dtype=logits.dtype))
    out_counts = out_counts[:, :vocab]
    seen = torch.zeros(rows, vocab + 1, device=logits.device, dtype=torch.bool)
    seen.scatter_(1, t.prompt_tokens, True)
    seen = seen[:, :vocab] | (out_counts > 0)
    rep = t.repetition_penalty[:, None].expand_as(logits)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    return logits - t.presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and smallest top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token stays if the mass strictly before it is under top_p: the first token always stays.
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits [R, V] float32 -> sampled ids; logprobs come from the raw logits, as in vLLM."""
        raw_logprobs = logits.log_softmax(dim=-1) if t.max_logprobs >= 0 else None
        if t.bias_rows is not None:
            logits = logits.index_put((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
        if t.repetition_penalty is not None:
            logits = apply_penalties(logits, t)
        greedy = logits.argmax(dim=-1)
        if t.all_greedy:
            token_ids = greedy
        else:
            temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
            logits = logits / temp[:, None]
            if t.need_top_k_top_p:
                logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
            probs = logits.softmax(dim=-1)
            if t.need_min_p:
                probs = probs.masked_fill(probs < t.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
            # Exponential race: argmax p / E with E ~ Exp(1) draws from p (normalising is unneeded).
            exp_noise = -torch.log(uniform_noise(t.seeds, t.counters, logits.shape[1])).float()
            sampled = (probs / exp_noise).argmax(dim=-1)
            token_ids = torch.where(t.temperature > 0, sampled, greedy)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None)
        ids, lps = gather_logprobs(raw_logprobs, token_ids, t.max_logprobs)
        return SamplerOutput(token_ids, ids, lps)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, 1 + k] ids and logprobs: each row's chosen token first, then its top k."""
    chosen = logprobs.gather(1, token_ids[:, None])
    if k == 0:
        return token_ids[:, None], chosen
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids[:, None], top_ids], 1), torch.cat([chosen, top_lps], 1)


def _pad(rows: list[list[int]], value: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0) or 1
    return [r + [value] * (width - len(r)) for r in rows]
