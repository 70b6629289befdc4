"""LLM(runner="pooling").embed against transformers: the final hidden states (AutoModel's last_hidden_state,
after the final norm) pooled the same way and normalised, for LAST, MEAN and CLS, one prompt and a batch,
prompts longer than a step's token budget (chunked prefill), on a tiny random Qwen3 and the embedded SmolLM2.
float32 engines, so that the same tolerance holds on a GPU (benchmarks/gpu_check.sh embed-tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from heron import LLM, SamplingParams
from heron.outputs import EmbeddingRequestOutput
from heron.pooling_params import PoolingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun by the river bank.",
    "Embeddings pool the final hidden states of every prompt token into a single vector.",
]
CHUNK = 16  # max_num_batched_tokens: the longer prompts take several steps


def reference(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def assert_close(out: EmbeddingRequestOutput, expected: torch.Tensor) -> None:
    assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=2e-5), out.request_id


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def hf_qwen3(qwen3):
    from transformers import AutoModel

    return AutoModel.from_pretrained(qwen3, dtype=torch.float32).eval()


def embedder(path, pooling: str | None = None, **kwargs) -> LLM:
    config = {"pooling_type": pooling} if pooling else None
    return LLM(
        path,
        runner="pooling",
        pooler_config=config,
        max_num_batched_tokens=CHUNK,
        max_model_len=256,
        dtype="float32",
        **kwargs,
    )


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(qwen3, hf_qwen3, pooling):
    llm = embedder(qwen3, pooling)
    tok = llm.get_tokenizer()
    assert max(len(tok.encode(p)) for p in PROMPTS) > CHUNK
    one = llm.embed(PROMPTS[1], use_tqdm=False)
    batch = llm.embed(PROMPTS, use_tqdm=False)
    assert len(one) == 1 and len(batch) == len(PROMPTS)
    assert_close(one[0], reference(hf_qwen3, tok.encode(PROMPTS[1]), pooling))
    for prompt, out in zip(PROMPTS, batch):
        assert out.finished and out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs.hidden_size == 64
        assert_close(out, reference(hf_qwen3, out.prompt_token_ids, pooling))
    # every block is back (the prefix cache may keep LAST's as evictable)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_pooling_params_and_truncation(qwen3, hf_qwen3):
    llm = embedder(qwen3)  # LAST: a decoder folder without sentence-transformers files
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    raw, cut, again = llm.embed(
        [PROMPTS[2], {"prompt_token_ids": ids}, PROMPTS[2]],
        [PoolingParams(normalize=False), PoolingParams(truncate_prompt_tokens=5), PoolingParams()],
        use_tqdm=False,
    )
    assert_close(raw, reference(hf_qwen3, ids, "LAST", normalize=False))
    assert cut.prompt_token_ids == ids[-5:]
    assert_close(cut, reference(hf_qwen3, ids[-5:], "LAST"))
    assert_close(again, reference(hf_qwen3, ids, "LAST"))  # (its blocks from the prefix cache, but the last)
    with pytest.raises(ValueError, match="^dimensions is not supported by this model"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed("word " * 300, use_tqdm=False)
    with pytest.raises(ValueError, match="it takes pooling requests"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)


def test_sentence_transformers_folder_and_matryoshka(qwen3, hf_qwen3, tmp_path):
    folder = tmp_path / "st"
    shutil.copytree(qwen3, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 64]}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))

    llm = LLM(
        str(folder), task="embed", max_model_len=256, dtype="float32"
    )  # vLLM's older spelling of runner="pooling"
    assert llm.engine.pooler_config.pooling_type == "MEAN"
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0]
    unnormalised = reference(hf_qwen3, ids, "MEAN", normalize=False)
    assert_close(out, torch.nn.functional.normalize(unnormalised[:16], dim=0))
    with pytest.raises(ValueError, match=r"^dimensions must be one of this model's matryoshka dimensions \(\[16, 64\]"):
        llm.embed("hi", PoolingParams(dimensions=32), use_tqdm=False)


def test_runner_mismatches_are_value_errors(qwen3):
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model"):
        LLM(qwen3, max_model_len=64).embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="contradicts runner"):
        LLM(qwen3, runner="generate", task="embed")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(qwen3, runner="pooling", pooler_config={"pooling_type": "MAX"})


def test_embedded_smollm2_matches_transformers():
    """SmolLM2 (the GGUF file, dequantized once by Heron's loader as transformers does: tests/models/
    test_gguf_loader.py) in Heron and in transformers' LlamaModel, from the same tensors."""
    from transformers import LlamaConfig, LlamaModel
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from heron.models.loader import load_source

    source = load_source(None)
    weights = dict(source.weights())
    source.weights = lambda: iter(weights.items())
    llm = LLM(
        source,
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        max_num_batched_tokens=CHUNK,
        max_model_len=128,
        dtype="float32",
    )
    config = LlamaConfig(**{k: v for k, v in source.hf_config.items() if k != "architectures"})
    with torch.device("meta"):  # no random init of weights about to be replaced
        model = LlamaModel(config)
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}, assign=True
    )
    model.rotary_emb = LlamaRotaryEmbedding(config)  # (its frequencies are a buffer the checkpoint does not hold)
    outs = llm.embed(PROMPTS[:2], use_tqdm=False)
    for out in outs:
        assert_close(out, reference(model.eval(), out.prompt_token_ids, "MEAN"))


def test_a_headless_base_model_checkpoint(qwen3, hf_qwen3, tmp_path):
    """An embedding model saved as its base model (architectures ["Qwen3Model"], no lm_head, as e5-mistral's
    "MistralModel"): Heron builds the causal LM with a zero LM head the pooler never reads."""
    hf_qwen3.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := Path(qwen3) / f).exists():
            shutil.copy(src, tmp_path / f)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = embedder(str(tmp_path), "LAST")
    out = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    assert_close(out, reference(hf_qwen3, out.prompt_token_ids, "LAST"))
