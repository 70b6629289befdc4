"""The GGUF conversion cache (heron/models/gguf_cache.py): the second load of a file reads no metadata from it
and gives the same model source (config, generation defaults, every weight, the tokenizer's ids, specials and
chat template); an edited file, an unreadable entry or an unwritable cache root each fall back to converting."""

from __future__ import annotations

import os

import gguf
import pytest
import torch

from heron.models import gguf_cache
from heron.models.gguf_loader import load_gguf
from tests.models.test_gguf_loader import TEMPLATE, _hf_tensors, _to_gguf, _write

DIMS = dict(hidden=32, heads=4, kv_heads=2, ffn=48, layers=2)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HERON_CACHE_DIR", str(root))
    return root


@pytest.fixture
def readers(monkeypatch):
    """Counts the GGUFReader instances made (one per conversion)."""
    made = []
    real = gguf.GGUFReader

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return made


def _tiny(path, shift: float = 0.0) -> str:
    hf = {name: t + shift for name, t in _hf_tensors(head_dim=8, untied=True, bias=True, **DIMS).items()}
    extra = lambda w: (w.add_eot_token_id(3), w.add_sampling_temp(0.6))  # noqa: E731
    return _write(path, "llama", _to_gguf(hf, {"attn_q": 4, "attn_k": 2}), extra=extra, **DIMS)


def _same_source(a, b) -> None:
    assert a.hf_config == b.hf_config and a.generation_config == b.generation_config and a.name == b.name
    wa, wb = dict(a.weights()), dict(b.weights())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ta, tb = a.tokenizer, b.tokenizer
    for text in ("hello hell", "<s>he ll</s> é"):
        assert ta(text).input_ids == tb(text).input_ids
    assert (ta.bos_token_id, ta.eos_token_id, ta.pad_token_id) == (tb.bos_token_id, tb.eos_token_id, tb.pad_token_id)
    assert ta.chat_template == tb.chat_template == TEMPLATE


def test_a_second_load_reads_the_cache(tmp_path, cache_dir, readers):
    path = _tiny(tmp_path / "tiny.gguf")
    first = load_gguf(path)
    assert len(readers) == 1 and os.path.isdir(gguf_cache.entry_dir(path))
    second = load_gguf(path)
    assert len(readers) == 1  # no parse of the file's metadata
    _same_source(first, second)


def test_an_edited_file_is_converted_again(tmp_path, cache_dir, readers):
    path = _tiny(tmp_path / "tiny.gguf")
    before = dict(load_gguf(path).weights())
    _tiny(tmp_path / "tiny.gguf", shift=1.0)  # same name, new weights
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    after = dict(load_gguf(path).weights())
    assert len(readers) == 2 and not torch.equal(before["lm_head.weight"], after["lm_head.weight"])


def test_an_unreadable_entry_is_made_again(tmp_path, cache_dir, readers):
    path = _tiny(tmp_path / "tiny.gguf")
    first = load_gguf(path)
    with open(os.path.join(gguf_cache.entry_dir(path), gguf_cache.CONTENTS), "w") as f:
        f.write("{not json")
    again = load_gguf(path)
    assert len(readers) == 2
    _same_source(first, again)
    load_gguf(path)
    assert len(readers) == 2  # the entry was written anew


def test_an_unwritable_root_still_loads(tmp_path, monkeypatch, readers, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HERON_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    path = _tiny(tmp_path / "tiny.gguf")
    with caplog.at_level("WARNING", logger="heron.models.gguf_cache"):
        src = load_gguf(path)
    assert src.hf_config["architectures"] == ["LlamaForCausalLM"] and dict(src.weights())
    assert "cannot cache" in caplog.text
    load_gguf(path)
    assert len(readers) == 2
