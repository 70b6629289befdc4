"""Multi-LoRA offline: random PEFT adapters (B != 0) on the tiny random models and the embedded model; Heron's
greedy output per adapter equals transformers + peft's, a batch mixing adapters and the base model (more
adapters than slots: evictions) equals each alone, the prefix cache is per adapter, a bad adapter is a
ValueError naming what is wrong and the engine serves on. Engines compared with peft run in float32, as peft does
here (the default on the CPU; on a GPU, where the default is bfloat16, greedy ids part after a few tokens)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from heron import LLM, LoRARequest, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is"]
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, target modules, rslora): every projection, a few, the MLP alone, rsLoRA's scaling
ADAPTERS = [
    (8, ALL, False),
    (4, ["q_proj", "v_proj"], False),
    (2, ["gate_proj", "up_proj", "down_proj"], False),
    (8, ALL, True),
]


def make_adapter(base, path, seed: int, rank: int, targets: list[str], rslora: bool = False) -> str:
    """A random adapter over the transformers model `base` (B random too: peft's init leaves it zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(path)
    peft_model.unload()  # the base model as it was, for the next adapter
    return str(path)


@torch.no_grad()
def hf_greedy(model, tok) -> list[list[int]]:
    """Greedy tokens by full forwards (no cache): on these tiny models much faster than `generate`."""
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, -NEW_TOKENS:].tolist())
    return out


def peft_greedy(base, adapter: str | None, tok) -> list[list[int]]:
    """transformers' greedy output, with the PEFT adapter at `adapter` (or none)."""
    from peft import PeftModel

    if adapter is None:
        return hf_greedy(base, tok)
    model = PeftModel.from_pretrained(base, adapter)
    try:
        return hf_greedy(model, tok)
    finally:
        model.unload()


@pytest.fixture(scope="module")
def llama(tiny_model_dir, tmp_path_factory):
    """(base folder, LoRARequests, the transformers + peft greedy outputs per request and for the base (None))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("llama")
    base, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    root = tmp_path_factory.mktemp("llama-loras")
    loras = [
        LoRARequest(f"a{i}", i, make_adapter(base, root / f"a{i}", i, *spec)) for i, spec in enumerate(ADAPTERS, 1)
    ]
    want = {lora: peft_greedy(base, lora and lora.lora_path, tok) for lora in [*loras, None]}
    return path, loras, want


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(
        llama[0],
        dtype="float32",
        kv_cache_memory=16 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
    )


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_matches_peft(llm, llama):
    _, loras, want = llama
    for lora in [*loras, None]:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == want[lora], lora
    assert len({str(w) for w in want.values()}) == len(want)  # every adapter changes the output


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(llm, llama, monkeypatch):
    _, loras, want = llama
    loads = []
    load = llm.engine.runner.lora.load
    monkeypatch.setattr(llm.engine.runner.lora, "load", lambda slot, lora: (loads.append(lora), load(slot, lora)))
    order = [None, *loras, loras[0], None]
    outs = llm.generate(
        [p for _ in order for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=[r for r in order for _ in PROMPTS]
    )
    got = _tokens(outs)
    for i, lora in enumerate(order):
        assert got[2 * i : 2 * i + 2] == want[lora], lora
    assert len(loads) > 2  # four adapters through two slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gathered_kernel_in_a_mixed_batch_matches_peft(llama):
    """On CUDA the delta is the Triton kernel (heron/kernels/lora.py); float32, as peft runs here."""
    path, loras, want = llama
    llm = LLM(
        path, device="cuda", dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, max_lora_rank=8
    )
    order = [None, *loras, loras[0], None]
    outs = llm.generate(
        [p for _ in order for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=[r for r in order for _ in PROMPTS]
    )
    got = _tokens(outs)
    for i, lora in enumerate(order):
        assert got[2 * i : 2 * i + 2] == want[lora], lora


def test_qwen3_adapter_matches_peft(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("qwen3")
    base, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    lora = LoRARequest("q", 1, make_adapter(base, tmp_path / "q", 0, 4, ALL, True))
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=4)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == peft_greedy(
        base, lora.lora_path, tok
    )


def test_the_prefix_cache_is_per_adapter(llm, llama):
    _, loras, _ = llama
    prompt = " ".join(["a long shared prefix for the cache"] * 8)
    bm = llm.engine.block_manager

    def hits(lora) -> int:
        before = bm.prefix_hits
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
        return bm.prefix_hits - before

    assert hits(loras[0]) == 0
    assert hits(loras[1]) == 0  # another adapter: none of the first one's blocks
    assert hits(None) == 0
    assert hits(loras[0]) > 0 and hits(loras[1]) > 0 and hits(None) > 0  # the same adapter: its own


def _edit_config(src: str, dst, **changes) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    json.dump({**cfg, **changes}, open(os.path.join(dst, "adapter_config.json"), "w"))
    return str(dst)


def test_a_bad_adapter_is_a_value_error_and_the_engine_serves_on(llm, llama, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    _, loras, want = llama
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    big = AutoModelForCausalLM.from_pretrained(llama[0])
    bad = {
        "not found": str(tmp_path / "nowhere"),
        "more than max_lora_rank": make_adapter(big, tmp_path / "big", 0, 16, ["q_proj"]),
        "the base model needs": make_adapter(qwen3, tmp_path / "qwen3", 0, 4, ["q_proj"]),
        "lm_head": make_adapter(big, tmp_path / "head", 0, 4, ["lm_head"]),
        "use_dora": None,
    }
    bad["only plain LoRA"] = _edit_config(loras[1].lora_path, tmp_path / "dora", use_dora=True)
    del bad["use_dora"]
    for i, (message, path) in enumerate(bad.items(), 100):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", i, path))
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras[0])) == want[loras[0]]


def test_lora_request_without_enable_lora_is_refused(tiny_model_dir, llama):
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=llama[1][0])


@pytest.mark.slow
def test_embedded_model_adapter_matches_peft(tmp_path):
    """The embedded SmolLM2 in transformers (from the tensors our GGUF loader reads, as tests/models/test_parity.py
    does) with a random adapter over every projection, against Heron with that adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from heron.models.gguf_loader import load_gguf
    from heron.models.loader import embedded_model_path

    try:
        source = load_gguf(embedded_model_path())
    except RuntimeError as e:  # (a machine without the embedded model's package: the GPU image)
        pytest.skip(str(e))
    base = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in source.hf_config.items() if k != "architectures"}))
    base.load_state_dict(dict(source.weights()), strict=False)
    base.tie_weights()
    base.eval()
    lora = LoRARequest("smol", 1, make_adapter(base, tmp_path / "smol", 0, 8, ALL))
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256, enable_lora=True, max_lora_rank=8)
    got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
    assert got == peft_greedy(base, lora.lora_path, llm.get_tokenizer())


def test_stats_name_the_adapters_running_and_waiting(llm, llama):
    """What the server's lora_requests_info shows: three adapters through two slots, one waits."""
    _, loras, _ = llama
    engine = llm.engine
    for i, lora in enumerate(loras[:3]):
        engine.add_request(f"stats-{i}", PROMPTS[0], SamplingParams(max_tokens=4), lora_request=lora)
    s = engine.get_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == ([], ["a1", "a2", "a3"])
    engine.step()
    s = engine.get_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == (["a1", "a2"], ["a3"])
    for i in range(3):
        engine.abort(f"stats-{i}")
    s = engine.get_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == ([], [])


def test_an_fp8_model_takes_adapters_in_its_activation_dtype(llama):
    """`--quantization fp8` with LoRA: the stacks are in the model's dtype (not the weights' float8), and the
    last token's logits equal peft's on the same row-quantized weights with W8A8 simulated on the base
    projections (the adapter's own matmuls see the unquantized input, in both)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heron.kernels.gemm.fp8 import quantize_fp8_rows
    from tests.models.test_quantization import W8A8_REL_ERR, _heron_logits, _hf_logits

    path, loras, _ = llama
    fp8 = LLM(  # on the CPU on any machine: W8A8's float32 reference (a GPU's _scaled_mm writes bfloat16)
        path, kv_cache_memory=16 << 20, quantization="fp8", enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu"
    )
    runner = fp8.engine.runner
    assert all(s.lora_a.dtype == runner.dtype != torch.float8_e4m3fn for s in runner.lora.stacks.values())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                q, s = quantize_fp8_rows(module.weight)
                module.weight.copy_(q.float() * s)
    ids = AutoTokenizer.from_pretrained(path)(PROMPTS[0]).input_ids
    lora = loras[0]
    model = PeftModel.from_pretrained(hf, lora.lora_path)
    ref = _hf_logits(model, ids, w8a8=True)
    base = _hf_logits(model.unload(), ids, w8a8=True)
    ours = _heron_logits(fp8, ids, lora)
    assert (ours - ref).norm() / ref.norm() < W8A8_REL_ERR
    assert (ref - base).norm() / ref.norm() > 10 * W8A8_REL_ERR  # the adapter moves the logits far more
