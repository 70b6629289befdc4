"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) run as their language model: the text tensors
under the checkpoint's names, the vision tower and projector left out, the text as transformers' full model gives
it. (The text-only Gemma3ForCausalLM's parity: tests/models/test_parity.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from heron import LLM, SamplingParams
from heron.models.gemma3 import language_model
from tests.conftest import TINY
from tests.models.test_parity import PROMPTS, capture_logits, hf_greedy


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory, embedded_tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = embedded_tokenizer
    text = dict(
        TINY,
        vocab_size=len(tok),
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("tiny-gemma3-mm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok, str(path)


def test_the_language_model_loads_and_matches_transformers(multimodal):
    model, tok, path = multimodal
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    assert any("vision_tower" in n for n in names) and any("language_model" in n for n in names)
    llm = LLM(path, kv_cache_memory=16 << 20)
    assert type(llm.engine.runner.model).__name__ == "Gemma3ForCausalLM"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, tok, PROMPTS[:3], 6)
    captured = capture_logits(llm)
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0, -1]
    assert (captured[0][0] - ref).norm() / ref.norm() < 1e-4


def test_checkpoint_names_map_to_the_text_model():
    t = torch.zeros(1)
    names = [
        "model.language_model.layers.0.mlp.up_proj.weight",  # transformers >= 4.52
        "language_model.model.norm.weight",  # earlier
        "language_model.lm_head.weight",
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "model.embed_tokens.weight",  # a text-only checkpoint's: unchanged
    ]
    assert [n for n, _ in language_model((n, t) for n in names)] == [
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.embed_tokens.weight",
    ]
