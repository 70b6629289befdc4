import math

import numpy as np
import pytest
import torch

from heron.batch import SamplingSpec
from heron.executor.sampler import Sampler, SamplingTensors, banned_tokens, uniform_noise
from heron.sampling_params import SamplingParams, StructuredOutputsParams

V = 50


def build(params: list[SamplingParams], seeds: list[int] | None = None, outputs=None) -> SamplingTensors:
    """Rows of 3-token prompts followed by `outputs` (row -> its output tokens so far)."""
    specs, positions, tokens = [], [], []
    for i, p in enumerate(params):
        out = (outputs or {}).get(i, [])
        specs.append(SamplingSpec.of(p, (seeds or [i] * len(params))[i], 0, 3))
        positions.append(len(out))
        tokens.append([1, 2, 3] + out)
    return SamplingTensors.build(specs, np.array(positions, dtype=np.int64), V, torch.device("cpu"), tokens=tokens)


def sample(logits, params, seeds=None, outputs=None):
    return Sampler()(logits, build(params, seeds, outputs))


def test_noise_is_a_pure_function_of_seed_and_counter():
    seeds, counters = torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5])
    u = uniform_noise(seeds, counters, 1000)
    assert torch.equal(u, uniform_noise(seeds, counters, 1000))
    assert ((u > 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(4, V)
    greedy = sample(logits, [SamplingParams(temperature=0)] * 4)
    top1 = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 4)
    assert torch.equal(greedy.token_ids, logits.argmax(-1))
    assert torch.equal(top1.token_ids, logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(logits[:1], [p], seeds=[1234]).token_ids
    others = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0)]
    mixed = sample(logits, [p] + others, seeds=[1234, 5, 6]).token_ids
    assert alone[0] == mixed[0]


@pytest.mark.parametrize("backend", ["auto", "torch"])  # CPU logits: inverse CDF, and the Gumbel race reference
def test_sampling_follows_the_distribution(backend):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3)))
    n = 4000
    params = [SamplingParams(temperature=1.0)] * n
    t = build(params, seeds=list(range(n)))
    ids = Sampler(backend)(logits.expand(n, V).clone(), t).token_ids
    freq = torch.bincount(ids, minlength=V)[:3].float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_p_and_min_p_exclude_the_tail():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4)) + 1e-12
    logits = probs.log().expand(200, V).clone()
    top_p = sample(logits, [SamplingParams(temperature=1, top_p=0.65)] * 200, seeds=list(range(200)))
    assert set(top_p.token_ids.tolist()) <= {0, 1}
    min_p = sample(logits, [SamplingParams(temperature=1, min_p=0.6)] * 200, seeds=list(range(200)))
    assert set(min_p.token_ids.tolist()) <= {0, 1}


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0] + [-10.0] * (V - 4)])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt holds tokens 1, 2, 3; the output so far holds token 3 twice
    t = build([p], outputs={0: [3, 3]})
    from heron.executor.sampler import apply_penalties

    out = apply_penalties(logits, t)[0, :4]
    expected = torch.tensor([2.0, -2.0, 0.25, 3.0 / 2 - 0.5 * 2 - 0.25])
    assert torch.allclose(out, expected)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(1, V)
    out = sample(logits, [SamplingParams(temperature=0, logit_bias={7: 5.0})])
    assert out.token_ids.item() == 7
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    logits[0, 9] = 10.0
    assert sample(logits, [p]).token_ids.item() != 9  # output position 0 < min_tokens
    assert sample(logits, [p], outputs={0: [1, 1]}).token_ids.item() == 9


def test_allowed_token_ids_restrict_their_rows_only():
    torch.manual_seed(3)
    n = 300
    logits = torch.randn(n, V)
    allowed = [4, 17, 30]
    params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed, logprobs=1)] * (n - 1) + [
        SamplingParams(temperature=0)
    ]
    out = sample(logits, params, seeds=list(range(n)))
    drawn = out.token_ids[:-1].tolist()
    assert set(drawn) == set(allowed)  # each allowed token drawn at least once over 299 rows, nothing else
    assert out.token_ids[-1].item() == logits[-1].argmax().item()  # a row without them: unrestricted
    # the logprobs reported are the raw ones (as vLLM's), not renormalized over the allowed tokens
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs[:-1, 0], raw[:-1].gather(1, out.token_ids[:-1, None])[:, 0])
    greedy = sample(logits[:1], [SamplingParams(temperature=0, allowed_token_ids=allowed)])
    assert greedy.token_ids.item() == allowed[int(logits[0, allowed].argmax())]


def test_bad_words_ban_their_last_token_after_the_rest():
    words = ((5,), (7, 8, 9))
    assert banned_tokens(words, [1, 7, 8]) == [5, 9]
    assert banned_tokens(words, [7, 8, 1]) == [5]
    assert banned_tokens(((7, 8, 9),), [8]) == []  # an output shorter than the word's start
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 5], logits[0, 3] = 5.0, 4.0, 1.0
    p = SamplingParams(temperature=0, bad_words_token_ids=words)
    assert sample(logits, [p], outputs={0: [7, 8]}).token_ids.item() == 3
    assert sample(logits, [p], outputs={0: [1, 8]}).token_ids.item() == 9
    assert build([p]).needs_host_tokens  # a word of several tokens reads the row's tokens every step
    assert not build([SamplingParams(bad_words_token_ids=((5,),))]).needs_host_tokens


@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"allowed_token_ids": []}, "at least one"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1], "structured_outputs": StructuredOutputsParams(regex="a")}, "cannot be combined"),
        ({"bad_words": [" "]}, "not blank"),
        ({"bad_words": ["a"], "allowed_token_ids": [1]}, "could ban every token"),
    ],
)
def test_token_restrictions_are_checked(kwargs, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="allowed_token_ids must be token ids below the vocabulary size"):
        SamplingParams(allowed_token_ids=[V]).verify_vocab(V)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_log_softmax_of_the_raw_logits(k):
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    out = sample(logits, [SamplingParams(temperature=0.8, logprobs=k)] * 2)
    ref = logits.log_softmax(-1)
    assert out.logprobs.shape == (2, 1 + k)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, out.token_ids[:, None])[:, 0])
    if k:
        assert torch.allclose(out.logprobs[:, 1:], ref.topk(k).values)
        assert math.isclose(out.logprobs[0, 1].item(), ref[0].max().item(), rel_tol=1e-6)


def test_the_sampled_tokens_rank_is_its_place_in_the_vocabulary():
    # Row 0's logit_bias forces a token whose raw logprob (what is reported) ranks far below the top 2; row 1
    # is greedy, row 2 draws.
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    forced = int(logits[0].argsort()[3])  # the 4th least likely
    params = [SamplingParams(temperature=0, logit_bias={forced: 100.0}, logprobs=2)]
    params += [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, logprobs=2)]
    out = sample(logits, params)
    order = logits.log_softmax(-1).argsort(-1, descending=True)  # brute force: each row's tokens by rank
    want = [1 + order[r].tolist().index(t) for r, t in enumerate(out.token_ids.tolist())]
    assert out.ranks.tolist() == want
    assert out.token_ids[0].item() == forced and want[0] == V - 3 and want[1] == 1


def _kept_by_definition(x: torch.Tensor, p: SamplingParams) -> set[int]:
    """Top-k by rank, then the top-p nucleus of softmax(x / T) over those, then min-p; in float64."""
    x = x.double()
    order = x.argsort(descending=True)
    k = p.top_k if p.top_k > 0 else len(x)
    allowed = order[:k]
    probs = torch.softmax(x[allowed] / p.temperature, -1)
    before = torch.cumsum(probs, 0) - probs
    keep = (before < p.top_p) & (probs >= p.min_p * probs.max())
    return set(allowed[keep].tolist())


# 8 < V: the full-sort fallback for wide nuclei; sort_rows: small batches sort every row
@pytest.mark.parametrize("candidates,sort_rows", [(1024, 0), (8, 0), (8, 100)])
def test_thresholds_match_their_definitions(monkeypatch, candidates, sort_rows):
    import heron.executor.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", candidates)
    monkeypatch.setattr(sampler_mod, "TOP_P_SORT_MAX_ROWS", sort_rows)
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.95),
        SamplingParams(temperature=0.7, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=12, min_p=0.3),
        SamplingParams(temperature=1.0, top_p=0.99),
        SamplingParams(temperature=1.0),
    ]
    torch.manual_seed(4)
    logits = torch.randn(len(params), V)
    t = build(params)
    thr = sampler_mod.sampling_thresholds(logits, t)
    for r, p in enumerate(params):
        assert set((logits[r] >= thr[r]).nonzero()[:, 0].tolist()) == _kept_by_definition(logits[r], p), r
    assert thr[-1] == float("-inf")
    # host summaries left out: derived from the tensors, same result
    t.max_top_k, t.need_top_p = None, None
    assert torch.equal(sampler_mod.sampling_thresholds(logits, t), thr)


def test_no_thresholds_without_restrictions():
    from heron.executor.sampler import sampling_thresholds

    t = build([SamplingParams(temperature=0.9)] * 2)
    assert sampling_thresholds(torch.randn(2, V), t) is None


def test_top_k_top_p_min_p_draws_stay_in_the_kept_set():
    torch.manual_seed(5)
    logits = torch.randn(1, V).expand(300, V).clone()
    for p in [SamplingParams(temperature=1.2, top_k=4, top_p=0.8), SamplingParams(temperature=0.6, min_p=0.25)]:
        ids = sample(logits, [p] * 300, seeds=list(range(300))).token_ids
        kept = _kept_by_definition(logits[0], p)
        assert set(ids.tolist()) <= kept and len(set(ids.tolist())) == len(kept) > 1


def test_topk_values_in_two_rounds():
    from heron.executor.sampler import topk_values

    torch.manual_seed(6)
    x = torch.randn(3, 10007)
    x[1, 100:200] = 5.0  # ties
    for k in (1, 7, 300):
        assert torch.equal(topk_values(x, k, chunk=1000), x.topk(k).values)


def test_cpu_draw_never_takes_nan_or_masked_tokens_nor_leaves_the_vocabulary():
    from heron.executor.sampler import sample_tokens_cpu

    x = torch.randn(4, V)
    x[0] = float("-inf")  # nothing to draw from: the argmax
    x[1, 3] = float("nan")
    x[2, 4] = float("inf")
    thr = torch.full((4,), -1e9)
    thr[3] = 1e9  # every token masked: the argmax
    for step in range(20):
        out = sample_tokens_cpu(x, torch.ones(4), thr, torch.arange(4), torch.full((4,), step))
        assert ((out >= 0) & (out < V)).all()
        assert out[1] != 3 and out[2] == 4 and out[3] == x[3].argmax()
