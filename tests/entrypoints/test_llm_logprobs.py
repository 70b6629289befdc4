"""The offline outputs' Logprob objects against a transformers forward of a tiny random Qwen3: each token's
logprob, its rank in the whole vocabulary (the prompt's tokens, greedy ones, and a token forced far past
the top k) and its text."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from heron import LLM, Logprob, SamplingParams

pytestmark = pytest.mark.slow

K = 3
FORCED = 1000  # an arbitrary token that logit_bias forces (its raw logprob, what is reported, ranks low)


def _check(lps: dict[int, Logprob], token: int, ref: torch.Tensor, decode) -> None:
    """One position: `token` and the top K, each with its logprob in `ref` (the position's full log-softmax),
    its rank (1 + the tokens above it, up to float noise between the two forwards) and its text."""
    assert token in lps and len(lps) in (K, K + 1)
    for t, lp in lps.items():
        assert isinstance(lp, Logprob) and lp.logprob == pytest.approx(ref[t].item(), abs=1e-4)
        assert 1 + int((ref > ref[t] + 1e-4).sum()) <= lp.rank <= 1 + int((ref > ref[t] - 1e-4).sum())
        assert lp.decoded_token == decode([t])
    assert sorted(lp.rank for lp in lps.values())[:K] == list(range(1, K + 1))


def test_ranks_and_texts_match_a_transformers_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3")
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory=64 << 20)
    decode = llm.get_tokenizer().decode
    prompt = llm.get_tokenizer().encode("The quick brown fox jumps over")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    outs = llm.generate([prompt, prompt], [params, replace(params, logit_bias={FORCED: 100.0})], use_tqdm=False)
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ranks = []
    for out in outs:
        c = out.outputs[0]
        ids = prompt + c.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # row p: the distribution of token p + 1
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(ids)):
            lps = out.prompt_logprobs[p] if p < len(prompt) else c.logprobs[p - len(prompt)]
            _check(lps, ids[p], ref[p - 1], decode)
        ranks.append([lps[t].rank for t, lps in zip(c.token_ids, c.logprobs)])
    assert ranks[0] == [1, 1, 1]  # greedy
    assert outs[1].outputs[0].token_ids == [FORCED] * 3 and min(ranks[1]) > K  # past the top K
