"""The offline API on the embedded model: shapes of outputs, sampling options end to end, bad input."""

from __future__ import annotations

import json
import math

import pytest

from heron import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_outputs_come_back_in_input_order_with_their_fields(embedded_llm):
    prompts = ["The sky is", "Name three colors:", [1, 504, 3255, 314]]
    outs = embedded_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The sky is", "Name three colors:", None]
    assert outs[2].prompt_token_ids == [1, 504, 3255, 314]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(c.token_ids) <= 5 and c.finish_reason in ("stop", "length")
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_chat_applies_the_template(embedded_llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = embedded_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tok = embedded_llm.get_tokenizer()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert out.outputs[0].text


def test_finish_reasons(embedded_llm):
    length = embedded_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert length[0].outputs[0].finish_reason == "length" and len(length[0].outputs[0].token_ids) == 3
    chat = embedded_llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False
    )[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.stop_reason is None  # the EOS token
    assert "<|im_end|>" not in chat.text


def test_same_seed_same_output_whatever_the_batch(embedded_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=42, ignore_eos=True)
    alone = embedded_llm.generate("A story about a fox:", p, use_tqdm=False)[0].outputs[0].token_ids
    batch = embedded_llm.generate(
        ["Unrelated", "A story about a fox:", "Also unrelated"],
        [SamplingParams(temperature=0.7, max_tokens=20), p, SamplingParams(temperature=0, max_tokens=3)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    other = embedded_llm.generate(
        "A story about a fox:",
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=43, ignore_eos=True),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(embedded_llm):
    engine = embedded_llm.engine
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one
    req = engine.add_request("n2", prompt, SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1))
    while len(req.seqs) < 2:
        engine.step()
    a, b = req.seqs
    assert a.block_table[:2] == b.block_table[:2]
    assert all(engine.block_manager.ref_count[x] == 2 for x in a.block_table[:2])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = [o for o in outs if o.finished][0]
    assert [c.index for c in final.outputs] == [0, 1] and all(len(c.token_ids) == 4 for c in final.outputs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_strings_cut_the_text(embedded_llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = "List the numbers from one to ten in words: one, two,"
    full = embedded_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[8:12]
    assert stop and stop in full
    cut = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = embedded_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]


def test_logprobs_and_prompt_logprobs(embedded_llm):
    out = embedded_llm.generate(
        "The quick brown fox",
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok].logprob == max(v.logprob for v in lp.values()) and lp[tok].rank == 1  # greedy: the most likely
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp and all(v.logprob <= 0 and v.rank >= 1 for v in lp.values())


def test_prompt_over_max_model_len_names_both_lengths(embedded_llm):
    with pytest.raises(ValueError, match=r"9000 tokens.*8192"):
        embedded_llm.generate([[5] * 9000], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        embedded_llm.generate("hi", SamplingParams(max_tokens=9000), use_tqdm=False)
    assert not embedded_llm.engine.has_unfinished()


def test_max_logprobs_bounds_what_a_request_may_ask(embedded_llm, tiny_model_dir):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} \(21\) is more than this engine's max_logprobs \(20;"):
            embedded_llm.generate("hi", SamplingParams(max_tokens=1, **{name: 21}), use_tqdm=False)
    assert not embedded_llm.engine.has_unfinished()
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory=16 << 20, max_logprobs=-1)  # -1: the whole vocabulary
    vocab = llm.engine.model_cfg.vocab_size
    out = llm.generate("hi", SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == vocab
    llm.shutdown()
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        LLM(tiny_model_dir("llama"), max_logprobs=-2)


def test_more_samples_than_max_num_seqs_is_refused(embedded_llm):
    with pytest.raises(ValueError, match=r"^n \(300\)"):
        embedded_llm.generate("hi", SamplingParams(n=300), use_tqdm=False)


INVALID_SAMPLING_FIELDS = [
    ("temperature", -1),
    ("temperature", 101),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2**31),
    ("top_k", 2**63),  # once crashed the engine's step (int64 overflow in the sampler)
    ("top_k", 5.0),
    ("n", 0),
    ("n", True),
    ("n", 2**31),
    ("max_tokens", 0),
    ("max_tokens", 2**31),
    ("min_tokens", -1),
    ("min_p", 2),
    ("min_p", -math.inf),
    ("presence_penalty", 3),
    ("presence_penalty", math.inf),
    ("frequency_penalty", -math.nan),
    ("repetition_penalty", 0),
    ("repetition_penalty", 101),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", "7"),
    ("logprobs", -1),
    ("logprobs", 2**31),
    ("prompt_logprobs", -1),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: 101}),
    ("logit_bias", {5: math.nan}),
]


@pytest.mark.parametrize("field,value", INVALID_SAMPLING_FIELDS)
def test_invalid_sampling_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_sampling_ranges_hold_at_their_edges(embedded_llm):
    """The largest values each range allows run through the sampler (top_k and seed land in int64 tensors)."""
    vocab = embedded_llm.engine.model_cfg.vocab_size
    edges = [
        SamplingParams(max_tokens=2, top_k=2**31 - 1, seed=2**63 - 1, temperature=100, logprobs=20),
        SamplingParams(max_tokens=2, top_k=0, seed=-(2**63), repetition_penalty=100, prompt_logprobs=20),
        SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=0.01, presence_penalty=-2, min_p=1.0),
        SamplingParams(max_tokens=2, min_tokens=2, logit_bias={vocab - 1: 100.0}, temperature=0),
        SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1], logit_bias={vocab - 1: 100.0}, temperature=0),
    ]
    outs = [o.outputs[0] for o in embedded_llm.generate(["Hello"] * len(edges), edges, use_tqdm=False)]
    assert all(len(o.token_ids) == 2 for o in outs[:4])
    assert outs[3].token_ids == [vocab - 1] * 2  # the bias was applied, not ignored
    assert outs[4].token_ids == [vocab - 1] and outs[4].finish_reason == "stop"


def test_allowed_token_ids_bound_what_is_drawn(embedded_llm):
    allowed = [17, 28, 905]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    out = embedded_llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)
    eos = embedded_llm.engine.eos_token_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids are all stop tokens"):
        embedded_llm.generate("Hello", SamplingParams(min_tokens=2, allowed_token_ids=[eos]), use_tqdm=False)
    assert not embedded_llm.engine.has_unfinished()


def test_bad_words_are_never_written(embedded_llm):
    prompt, greedy = "The capital of France is", dict(temperature=0, max_tokens=12, ignore_eos=True)
    first = embedded_llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    word = first.text.split()[0]
    spellings = embedded_llm.engine._bad_words_token_ids([word])

    def holds(ids: list[int], s: tuple[int, ...]) -> bool:
        return any(tuple(ids[i : i + len(s)]) == s for i in range(len(ids)))

    assert any(holds(first.token_ids, s) for s in spellings)  # the word was written without the ban
    out = embedded_llm.generate(prompt, SamplingParams(bad_words=[word], **greedy), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and not any(holds(out.token_ids, s) for s in spellings)


def test_token_ids_outside_the_vocabulary_are_refused(embedded_llm):
    vocab = embedded_llm.engine.model_cfg.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 5.0}), SamplingParams(stop_token_ids=[vocab])):
        with pytest.raises(ValueError, match=f"below the vocabulary size \\({vocab}\\)"):
            embedded_llm.generate("hi", params, use_tqdm=False)
    assert not embedded_llm.engine.has_unfinished()


def test_unknown_architecture_names_the_supported_ones(tmp_path, tiny_model_dir):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        LLM(str(path), kv_cache_memory=16 << 20)


def test_chunked_prefill_cannot_be_turned_off(tiny_model_dir):
    with pytest.raises(ValueError, match="enable_chunked_prefill: prefills are always chunked"):
        LLM(tiny_model_dir("llama"), kv_cache_memory=16 << 20, enable_chunked_prefill=False)


def test_generation_config_and_its_override_set_the_default_sampling(tmp_path, tiny_model_dir):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))

    def defaults(**kwargs) -> tuple:
        llm = LLM(str(path), kv_cache_memory=16 << 20, **kwargs)
        p = llm.get_default_sampling_params()
        llm.shutdown()
        return p.temperature, p.top_p, p.top_k

    assert defaults() == (0.7, 0.9, SamplingParams().top_k)
    assert defaults(override_generation_config={"temperature": 0.25, "top_k": 5}) == (0.25, 0.9, 5)
    plain = SamplingParams()  # generation_config "vllm": none from the folder
    assert defaults(generation_config="vllm", override_generation_config={"top_k": 5}) == (
        plain.temperature,
        plain.top_p,
        5,
    )
    with pytest.raises(ValueError, match="override_generation_config: max_new_tokens cannot be set"):
        LLM(str(path), override_generation_config={"max_new_tokens": 8})
    with pytest.raises(ValueError, match="temperature must be a number"):
        LLM(str(path), kv_cache_memory=16 << 20, override_generation_config={"temperature": -1})


def test_corrupt_weight_file_is_named(tmp_path, tiny_model_dir):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(path), kv_cache_memory=16 << 20)


def test_generate_iter_reads_a_generator_a_window_at_a_time(embedded_llm):
    read = []

    def prompts():
        for i in range(12):
            read.append(i)
            yield [1 + i, 2, 3]

    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = embedded_llm.generate([[1 + i, 2, 3] for i in range(12)], p, use_tqdm=False)
    it = embedded_llm.generate_iter(prompts(), p, window=4)
    first = next(it)
    assert len(read) <= 5  # the window, and the one read that found it full
    got = [first, *it]
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in embedded_llm.generate(iter([[1, 2, 3]]), p, use_tqdm=False)] == [
        want[0].outputs[0].token_ids
    ]
    assert not embedded_llm.engine.has_unfinished()
