import pytest
import torch

from heron.bench.datasets import random_token_requests
from heron.bench.hf_baseline import generate_batch, load_hf_model, run_hf, run_hf_latency


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"))


def test_static_batches_count_only_each_requests_own_tokens(tiny_hf):
    reqs = random_token_requests(5, (3, 9), (1, 6), seed=2)
    run = run_hf(tiny_hf, reqs, batch_size=2, temperature=0.6)
    lens = sorted((r.output_len for r in reqs), reverse=True)
    assert run.output_tokens == sum(lens) and run.num_requests == 5
    # longest first, two per batch; every row runs to its batch's longest output
    assert run.generated_tokens == 2 * lens[0] + 2 * lens[2] + 1 * lens[4]
    assert run.seconds > 0 and run.output_tokens_per_s == run.output_tokens / run.seconds


def test_left_padding_does_not_change_greedy_tokens(tiny_hf):
    short, long = [5, 6, 7], [9, 8, 7, 6, 5, 4, 3]
    alone = generate_batch(tiny_hf, [short], 6, 0.0)
    together = generate_batch(tiny_hf, [long, short], 6, 0.0)
    assert together.shape == (2, 6)
    assert torch.equal(together[1], alone[0])


def test_latency_times_come_from_one_call_and_cannot_go_negative(tiny_hf):
    """TTFT and decode time are stamped inside one `generate` call: both positive, and together no longer
    than the call (the old difference of two separately timed calls went negative on a busy machine)."""
    m = run_hf_latency(tiny_hf, [5, 6, 7, 8], output_len=6, temperature=0.0, iters=3)
    assert m["hf_ttft_ms"] > 0 and m["hf_decode_ms_per_token"] > 0
    call_ms = 6 / m["hf_output_tokens_per_s"] * 1e3
    assert m["hf_ttft_ms"] + 5 * m["hf_decode_ms_per_token"] <= call_ms
    with pytest.raises(ValueError, match="at least 2 output tokens"):
        run_hf_latency(tiny_hf, [5, 6], output_len=1, temperature=0.0, iters=1)


@pytest.mark.slow
def test_embedded_model_matches_heron_greedy():
    """The baseline runs the same weights as Heron: the embedded GGUF, read by Heron's loader into transformers."""
    from heron import LLM, SamplingParams

    prompt = [1, 504, 3458, 282, 4649, 314]
    hf = load_hf_model(None, torch.float32, torch.device("cpu"))
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    theirs = generate_batch(hf, [prompt], 12, 0.0)[0].tolist()
    ours = LLM(kv_cache_memory=1 << 26, max_model_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert ours[0].outputs[0].token_ids == theirs
