"""Batched sampling on tensors: penalties, logit bias, temperature, top-k / top-p / min-p, then one draw.

Randomness is counter-based: the noise for (request seed, sample index, output position, token) is a
hash of those four numbers, so a seeded request draws the same tokens whatever else shares its batch,
and no per-request generator or Python loop is needed.

The draw (`sample_tokens_torch`, and `heron.kernels.sampling.sample_tokens`, its one-pass Triton twin used
for CUDA logits) is the exponential race argmax(p / E), E ~ Exp(1), taken in log space: argmax over the
kept tokens of `logit * (1 / T) + g`, g = -log(E) (`gumbel_noise`). Top-k, top-p and min-p become one
per-row logit threshold (`sampling_thresholds`, shared by both paths): a token is kept iff its logit >= the
threshold. Greedy rows (T = 0) take the argmax. Ties go to the lowest token id.

CPU logits take another draw of the same distribution, `sample_tokens_cpu`: inverse-CDF sampling with one
hashed uniform per row, as counter-based (seeded rows stay independent of their batch) at a fraction of the
cost of hashing every token. A seed therefore draws other tokens on the CPU than on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from heron.batch import SamplingSpec
from heron.kernels.reference import apply_token_bitmask_ref

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed 64-bit integer
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
# Top-p looks for its cut-off among each row's this many highest logits (a full sort only for rows whose
# nucleus is larger; rows with top-k are always covered, the candidates being at least max top-k).
TOP_P_CANDIDATES = 1024
TOPK_CHUNK = 2048  # see topk_values
TOPK_TWO_ROUND_MAX_ROWS = 16
TOP_P_SORT_MAX_ROWS = 16  # up to this many rows top-p sorts them instead (H200: faster up to ~8-16 rows)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser: a bijection of int64 that scatters every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64 uniforms in (0, 1), a pure function of (seeds[r], counters[r], v): (k + 1/2) / 2^52
    for 52 hash bits k, exact in float64 (so never 0 or 1)."""
    row = _mix(_mix(seeds) + counters * _GOLDEN)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _shr(_mix(row[:, None] + v[None, :] * _GOLDEN), 12)  # 52 random bits
    return (bits.double() + 0.5) * (1.0 / (1 << 52))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 Gumbel(0, 1) noise g = -log(E), E = -log(1 - w) ~ Exp(1), from the same 52 hash bits k as
    uniform_noise: w = fl32(fl32(k) + 1/2) * 2^-52, capped below 1. E is log1p(-w) by Goldberg's formula
    (accurate for small w, where the winners of the race are). Every step is one correctly rounded float32
    operation or a log, as in heron.kernels.sampling, so both give the same values."""
    row = _mix(_mix(seeds) + counters * _GOLDEN)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _shr(_mix(row[:, None] + v[None, :] * _GOLDEN), 12)
    w = ((bits.float() + 0.5) * 2.0**-52).clamp_(max=1.0 - 2.0**-24)
    z = 1.0 - w
    one = z == 1.0  # w < 2^-25: -log1p(-w) rounds to w
    e = torch.where(one, w, torch.log(z) * w / torch.where(one, -1.0, z - 1.0))
    return -torch.log(e)


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
    # allowed_token_ids: the rows that have them, and (row, token) pairs of what each allows
    allowed_rows: torch.Tensor | None
    allowed_pairs: tuple[torch.Tensor, torch.Tensor] | None
    all_greedy: bool
    needs_host_tokens: bool  # a row reads its tokens on the host (penalties, bad words): the step is read back at once
    need_min_p: bool
    max_logprobs: int  # -1: no row wants logprobs
    # Host-side summaries (None: derived from the tensors, at the cost of a device sync).
    max_top_k: int | None = None  # largest top-k below the vocab size among sampled rows; 0: none
    need_top_p: bool | None = None  # some sampled row has top_p < 1
    token_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32 of structured outputs, or None

    @classmethod
    def build(
        cls,
        specs: list[SamplingSpec],
        positions: np.ndarray,
        vocab: int,
        dev: torch.device,
        staging: tuple[np.ndarray, np.ndarray, tuple[torch.Tensor, ...]] | None = None,
        tokens: list[list[int]] | None = None,
    ) -> SamplingTensors:
        """One row per token to sample: its sampling constants (`specs`) and the output position of the token
        it draws (`positions`, int64). `staging`: the model runner's host arrays float32 [3, S] and int64
        [3, S] and the device views of their first len(specs) columns, row by row (temperature, top_p,
        min_p, top_k, seed, counter); the six per-row arrays are written there and the caller copies them
        with the step's other inputs. Without it they are copied here. The rare penalty and bias tensors
        are always made here; penalties read each row's `tokens` (its sequence's tokens on the host:
        prompt, then output)."""
        n = len(specs)
        hf, hi, dev_rows = staging or (np.empty((3, n), np.float32), np.empty((3, n), np.int64), None)
        hf[:, :n] = np.array([s.floats for s in specs], dtype=np.float32).reshape(n, 3).T
        ints = np.array([s.ints for s in specs], dtype=np.int64).reshape(n, 4)
        top_k = np.where((ints[:, 0] > 0) & (ints[:, 0] < vocab), ints[:, 0], vocab)
        hi[0, :n] = top_k
        hi[1, :n] = ints[:, 1]
        hi[2, :n] = (positions << 20) | ints[:, 3]  # output position and sample index
        if dev_rows is None:
            df, di = torch.from_numpy(hf).to(dev), torch.from_numpy(hi).to(dev)
            dev_rows = (*df, *di)
        sampled = hf[0, :n] > 0  # rows that draw (the others are greedy)
        all_greedy = not sampled.any()  # (then the sampler takes the argmax, and no threshold is needed)
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).to(dev, non_blocking=True)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).to(dev, non_blocking=True)
        extras = [i for i, s in enumerate(specs) if s.has_extras]
        params = [specs[i].params for i in extras]
        penalized = any(p.has_penalties for p in params)
        prompt_tokens = output_tokens = None
        if penalized:  # every row gets penalty values (1 and 0 for the rows without)
            params = [s.params for s in specs]
            prompt_tokens = i64(_pad([t[: s.num_prompt_tokens] for s, t in zip(specs, tokens)], vocab))
            # (the tokens of a step in flight are not on the host: LLMEngine reads a penalised row's token
            # back before its next step, and other rows' counts do not matter)
            output_tokens = i64(_pad([t[s.num_prompt_tokens :] for s, t in zip(specs, tokens)], vocab))
        bias = []  # (row, token, value): logit_bias, and -inf on stop tokens until min_tokens are out
        allowed: list[tuple[int, np.ndarray]] = []  # (row, its allowed_token_ids)
        for r in extras:
            p = specs[r].params
            bias += [(r, tok, b) for tok, b in (p.logit_bias or {}).items() if 0 <= tok < vocab]
            if positions[r] < p.min_tokens:
                bias += [(r, tok, float("-inf")) for tok in p.all_stop_token_ids if 0 <= tok < vocab]
            if p.bad_words_token_ids:
                output = tokens[r][specs[r].num_prompt_tokens :]
                bias += [(r, tok, float("-inf")) for tok in banned_tokens(p.bad_words_token_ids, output)]
            if p.allowed_token_ids:
                allowed.append((r, p.allowed_token_array))
        bias_cols = list(zip(*bias)) if bias else None
        return cls(
            temperature=dev_rows[0],
            top_p=dev_rows[1],
            min_p=dev_rows[2],
            top_k=dev_rows[3],
            seeds=dev_rows[4],
            counters=dev_rows[5],
            presence_penalty=f32([p.presence_penalty for p in params]) if penalized else None,
            frequency_penalty=f32([p.frequency_penalty for p in params]) if penalized else None,
            repetition_penalty=f32([p.repetition_penalty for p in params]) if penalized else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            bias_rows=i64(bias_cols[0]) if bias else None,
            bias_tokens=i64(bias_cols[1]) if bias else None,
            bias_values=f32(bias_cols[2]) if bias else None,
            allowed_rows=i64([r for r, _ in allowed]) if allowed else None,
            allowed_pairs=_allowed_pairs(allowed, dev) if allowed else None,
            all_greedy=all_greedy,
            needs_host_tokens=penalized or any(len(w) > 1 for p in params for w in p.bad_words_token_ids),
            need_min_p=not all_greedy and bool((hf[2, :n] > 0).any()),
            max_logprobs=int(ints[:, 2].max(initial=-1)),
            max_top_k=0 if all_greedy else int(top_k[sampled & (top_k < vocab)].max(initial=0)),
            need_top_p=not all_greedy and bool((sampled & (hf[1, :n] < 1.0)).any()),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    logprob_token_ids: torch.Tensor | None  # [R, 1 + K]: the sampled token, then the top K
    logprobs: torch.Tensor | None  # [R, 1 + K]
    ranks: torch.Tensor | None  # [R]: the sampled token's rank (the top K are ranked 1..K)


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


def sampling_thresholds(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor | None:
    """[R] float32 logit thresholds from top-k, top-p and min-p (a sampled row keeps the tokens whose logit is
    >= its threshold; -inf keeps all), or None when no row restricts its tokens. Greedy rows' values are
    unused. Ties at a cut-off value are all kept.

    - top-k: the k-th largest logit (one `topk` over the rows, of the largest k asked for);
    - top-p: on softmax(top-k-masked logits / T), the logit of the last token of the smallest descending
      prefix whose mass reaches top_p (the mass strictly before it is < top_p). Searched among the
      TOP_P_CANDIDATES highest logits (the same `topk`, normalised by the full row's log-sum-exp); only rows
      whose nucleus is larger are sorted in full (all rows, when there are at most TOP_P_SORT_MAX_ROWS);
    - min-p: max logit + T * log(min_p) (p >= min_p * p_max in logit space)."""
    rows, vocab = logits.shape
    top_k, top_p, min_p = t.top_k, t.top_p, t.min_p
    kmax = t.max_top_k
    if kmax is None:
        capped = top_k[top_k < vocab]
        kmax = int(capped.max()) if capped.numel() else 0
    need_top_p = t.need_top_p if t.need_top_p is not None else bool((top_p < 1.0).any())
    if kmax == 0 and not need_top_p and not t.need_min_p:
        return None
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature)).float()
    inv_t = 1.0 / temp
    thr = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    num_cand = min(vocab, max(kmax, TOP_P_CANDIDATES if need_top_p else 0))
    if need_top_p and rows <= TOP_P_SORT_MAX_ROWS:
        num_cand = vocab  # one sort: for a few rows, cheaper than candidates + normaliser + maybe a sort
    top = topk_values(logits, num_cand).float() if num_cand else None  # [R, C], descending
    if kmax:
        kth = top.gather(1, (top_k.clamp(1, num_cand) - 1)[:, None])[:, 0]
        thr = torch.where(top_k < vocab, kth, thr)
    if need_top_p:
        thr = torch.maximum(thr, _top_p_thresholds(logits, top, top_k, top_p, inv_t))
    if t.need_min_p:
        row_max = top[:, 0] if top is not None else logits.amax(dim=-1).float()
        thr = torch.where(min_p > 0, torch.maximum(thr, row_max + temp * torch.log(min_p)), thr)
    return thr


def topk_values(x: torch.Tensor, k: int, chunk: int | None = None) -> torch.Tensor:
    """The k largest values of each row of x [R, V], descending; the same values as x.topk(k).values. Long
    rows go in two rounds: the top k of each chunk of `chunk` tokens (many short independent rows, which
    torch.topk handles far faster than a few long ones), then the top k of those candidates."""
    rows, vocab = x.shape
    if k >= vocab:
        return x.sort(dim=-1, descending=True).values
    chunk = chunk or max(TOPK_CHUNK, 4 * k)
    n = vocab // chunk
    # on an H200 (V 151936) two rounds halve one row's time for k <= 256, but double 256 rows' time
    if n < 4 or rows > TOPK_TWO_ROUND_MAX_ROWS:
        return x.topk(k, dim=-1).values
    head = x[:, : n * chunk].reshape(rows, n, chunk).topk(k, dim=-1, sorted=False).values.reshape(rows, n * k)
    return torch.cat([head, x[:, n * chunk :]], dim=1).topk(k, dim=-1).values


def _row_logsumexp(x: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    kernels = _triton_kernels() if x.is_cuda else None
    if kernels is not None:  # one pass instead of ~8 over [R, V] (H200, R 256, V 151936: 0.42 -> 0.04 ms)
        return kernels.row_logsumexp(x, inv_t)
    return torch.logsumexp(x.float() * inv_t[:, None], dim=-1)


def _top_p_thresholds(
    logits: torch.Tensor, top: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, inv_t: torch.Tensor
) -> torch.Tensor:
    vocab, num_cand = logits.shape[1], top.shape[1]
    rank = torch.arange(num_cand, device=logits.device)
    scaled = (top * inv_t[:, None]).masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    covered = top_k <= num_cand  # the candidates hold every token the row's top-k allows
    lse = torch.logsumexp(scaled, dim=-1)
    if num_cand < vocab:  # rows without top-k: normalise over the whole row
        lse = torch.where(covered, lse, _row_logsumexp(logits, inv_t))
    n_keep, cut = _nucleus(top, scaled, lse, top_p)
    if num_cand < vocab:
        missed = ~covered & (n_keep >= num_cand) & (top_p < 1.0)  # the cut-off lies past the candidates
        if bool(missed.any()):
            idx = missed.nonzero()[:, 0]
            full = logits[idx].float().sort(dim=-1, descending=True).values  # no top-k: nothing masked
            cut = cut.index_put((idx,), _nucleus(full, full * inv_t[idx, None], lse[idx], top_p[idx])[1])
    return torch.where(top_p < 1.0, cut, torch.full_like(cut, float("-inf")))


def _nucleus(
    values: torch.Tensor, scaled: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, C] descending and their scaled (masked) logits -> (tokens kept, cut-off value) per row."""
    probs = torch.exp(scaled - lse[:, None])
    before = torch.cumsum(probs, dim=-1)
    before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=1)  # mass strictly before
    n_keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)
    return n_keep, values.gather(1, (n_keep - 1)[:, None])[:, 0]


def sample_tokens_cpu(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    thresholds: torch.Tensor | None,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """The draw for CPU logits: inverse-CDF sampling with one counter-based uniform per row (the hash of
    (seed, counter) over [R], not [R, V]), so a CPU step pays one exp and one cumsum per logit instead of
    hashing every token (which took half of a small model's CPU step). Same semantics as the Gumbel race
    (the same distribution; a seeded row draws the same tokens whatever shares its batch) but other tokens
    than `sample_tokens_torch` / the CUDA kernel for the same seed: CPU and GPU streams differ."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    inv_t = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(x.nan_to_num(nan=float("-inf")) * inv_t[:, None], dim=-1)  # NaN never drawn
    if thresholds is not None:  # (a product with the mask: much faster on the CPU than masked_fill / where)
        probs = probs.mul_(x >= thresholds[:, None])
    cdf = probs.cumsum_(dim=-1)
    # u in (0, 1), so 0 < target <= the kept mass: the first token whose cumulative mass reaches the target
    # adds mass, i.e. is kept (each row's maximum always is).
    u = uniform_noise(seeds, counters, 1)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, (u * total).float()).squeeze(1).clamp_(max=x.shape[1] - 1)
    # a row with nothing to draw from (all -inf, every token masked, +inf logits) takes the argmax
    drawn = torch.where((total[:, 0] > 0) & torch.isfinite(total[:, 0]), drawn, greedy)
    return torch.where(temperature > 0, drawn, greedy)


def sample_tokens_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    thresholds: torch.Tensor | None,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """The draw in PyTorch ([R, V] temporaries): the reference for heron.kernels.sampling.sample_tokens,
    which computes the same tokens in one pass. Greedy rows (temperature 0): argmax of the logits; others:
    argmax over tokens with logit >= threshold of logit * (1 / T) + Gumbel noise; lowest id on ties."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    inv_t = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    keep = x >= (thresholds[:, None] if thresholds is not None else float("-inf"))  # NaN never kept
    score = torch.where(keep, x * inv_t[:, None], float("-inf")) + gumbel_noise(seeds, counters, x.shape[1])
    return torch.where(temperature > 0, score.argmax(dim=-1), greedy)


@functools.cache
def _triton_kernels():
    """heron.kernels.sampling, or None without a working Triton."""
    try:
        from heron.kernels import sampling
    except Exception:  # noqa: BLE001 - ImportError, or a Triton that fails to initialise
        return None
    return sampling


class Sampler:
    def __init__(self, backend: str = "auto"):
        """backend: "auto" (the Triton kernel for CUDA logits when Triton imports, `sample_tokens_cpu` for CPU
        logits), "torch" (`sample_tokens_torch`, the kernel's reference) or "triton" (also on CPU tensors,
        under TRITON_INTERPRET=1)."""
        assert backend in ("auto", "torch", "triton"), backend
        self.backend = backend

    def _draw(self, logits: torch.Tensor):
        if self.backend == "auto" and not logits.is_cuda:
            return sample_tokens_cpu  # (Triton is not even imported)
        if self.backend == "torch":
            return sample_tokens_torch
        kernels = _triton_kernels()
        if kernels is None:
            assert self.backend == "auto", "Triton is not available"
            return sample_tokens_torch
        return kernels.sample_tokens

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits [R, V] float32 -> sampled ids; logprobs come from the raw logits, as in vLLM."""
        if t.token_bitmask is not None:  # (before the logprobs: a constrained row's are over its allowed tokens)
            logits = apply_token_bitmask(logits, t.token_bitmask)
        raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32) if t.max_logprobs >= 0 else None
        if t.bias_rows is not None:
            logits = logits.index_put((t.bias_rows, t.bias_tokens), t.bias_values.to(logits.dtype), accumulate=True)
        if t.repetition_penalty is not None:
            logits = apply_penalties(logits, t)
        if t.allowed_rows is not None:
            logits = apply_allowed_token_ids(logits, t.allowed_rows, t.allowed_pairs)
        if t.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            thresholds = sampling_thresholds(logits, t)
            token_ids = self._draw(logits)(logits, t.temperature, thresholds, t.seeds, t.counters)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        return SamplerOutput(token_ids, *gather_logprobs(raw_logprobs, token_ids, t.max_logprobs))


def apply_allowed_token_ids(
    logits: torch.Tensor, rows: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """-inf on every token of `rows` but the (row, token) `pairs` they allow; the other rows unchanged."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[rows] = False
    keep[pairs] = True
    return logits.masked_fill(~keep, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs' mask, in place: -inf on each row's tokens whose bit is 0 in `bitmask` [R, ceil(V / 32)]
    int32 (xgrammar's layout), after a captured graph's logits: heron/kernels/token_bitmask.py's kernel on a GPU,
    its reference elsewhere. Returns `logits`."""
    if logits.is_cuda:
        from heron.kernels.token_bitmask import apply_token_bitmask_

        return apply_token_bitmask_(logits, bitmask)
    return apply_token_bitmask_ref(logits, bitmask)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, 1 + k] ids and logprobs: each row's chosen token first, then its top k; and [R] the chosen token's
    rank, 1 + the count of its row's logprobs above its own (one more pass over the rows, on the device:
    it is read back with the rest, no sync of its own)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    if k == 0:
        return token_ids[:, None], chosen, ranks
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids[:, None], top_ids], 1), torch.cat([chosen, top_lps], 1), ranks


def banned_tokens(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The bad words' tokens the next draw may not take: each word's last token, where the output so far ends
    with the rest of it (a one-token word: always)."""
    return [w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == list(w[:-1])]


def _allowed_pairs(allowed: list[tuple[int, np.ndarray]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of each row's allowed tokens."""
    rows = np.repeat([r for r, _ in allowed], [len(a) for _, a in allowed])
    tokens = np.concatenate([a for _, a in allowed])
    return torch.from_numpy(rows).to(dev, non_blocking=True), torch.from_numpy(tokens).to(dev, non_blocking=True)


def _pad(rows: list[list[int]], value: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0) or 1
    return [r + [value] * (width - len(r)) for r in rows]
