"""The loader's hub options (vLLM's --revision, --tokenizer-revision, --download-dir), against a real
huggingface_hub cache laid out in a temporary folder and read offline: a hub id loads the snapshot its
revision names, from the cache folder given."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from heron.config import ModelConfig
from heron.models.loader import HubOptions, load_configured, load_source


def _snapshot(cache: Path, repo: str, ref: str, commit: str, folder: str) -> None:
    """`folder`'s files as commit `commit` of `repo` in the hub cache `cache`, with `ref` pointing at it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A hub cache holding org/tiny at main (a tiny Llama) and at v1 (a tiny Qwen3); the hub out of reach."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _snapshot(tmp_path, "org/tiny", "main", "a" * 40, tiny_model_dir("llama"))
    _snapshot(tmp_path, "org/tiny", "v1", "b" * 40, tiny_model_dir("qwen3"))
    return tmp_path


def test_a_hub_id_loads_the_snapshot_its_revision_names_from_the_download_dir(hub):
    assert load_source("org/tiny", hub=HubOptions(download_dir=str(hub))).hf_config["model_type"] == "llama"
    v1 = load_source("org/tiny", hub=HubOptions(revision="v1", download_dir=str(hub)))
    assert v1.hf_config["model_type"] == "qwen3" and v1.name == "org/tiny"
    config = ModelConfig("org/tiny", revision="v1", download_dir=str(hub))
    assert load_configured(config).hf_config["model_type"] == "qwen3"


def test_a_revision_the_cache_lacks_is_a_clear_error(hub):
    with pytest.raises(ValueError, match="model 'org/tiny' at revision 'v9' is neither a local folder"):
        load_source("org/tiny", hub=HubOptions(revision="v9", download_dir=str(hub)))


def test_the_tokenizer_revision_picks_the_tokenizer_snapshot(hub, tmp_path, tiny_model_dir, embedded_tokenizer):
    other = tmp_path / "tok-v2"  # main's files, with a token added to the tokenizer
    shutil.copytree(tiny_model_dir("llama"), other)
    tok = type(embedded_tokenizer).from_pretrained(other)
    tok.add_tokens(["<heron-test-token>"])
    tok.save_pretrained(other)
    _snapshot(hub, "org/tiny", "tok-v2", "c" * 40, str(other))
    options = HubOptions(revision="v1", tokenizer_revision="tok-v2", download_dir=str(hub))
    src = load_source("org/tiny", hub=options)
    assert src.hf_config["model_type"] == "qwen3"  # the weights at v1, the tokenizer at tok-v2
    assert len(src.tokenizer) == len(embedded_tokenizer) + 1
    assert len(load_source("org/tiny", hub=HubOptions(revision="v1", download_dir=str(hub))).tokenizer) == len(
        embedded_tokenizer
    )


def test_hub_options_for_a_local_model_are_refused(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="revision picks a hub id's snapshot, and the model is a local one"):
        ModelConfig(folder, revision="v1").verify()
    with pytest.raises(ValueError, match="tokenizer_revision picks .* the tokenizer is a local one"):
        ModelConfig("org/tiny", tokenizer=folder, tokenizer_revision="v1").verify()
    ModelConfig(folder, download_dir="/tmp/hub").verify()  # where hub ids would go: nothing to fetch here


def test_safetensors_refuses_a_gguf_model():
    with pytest.raises(ValueError, match="load_format 'safetensors' reads a folder's"):
        load_source(None, load_format="safetensors")


def test_the_offline_llm_takes_the_hub_options(hub):
    from heron import LLM

    llm = LLM("org/tiny", revision="v1", download_dir=str(hub), device="cpu", kv_cache_memory=16 << 20)
    try:
        assert llm.engine.model_cfg.qk_norm  # Qwen3's, where main's Llama has none
    finally:
        llm.shutdown()
