"""What a pooling model's folder says about its embeddings: the pooling of a sentence-transformers folder
(modules.json naming a Pooling module, whose config.json sets one pooling_mode_*), and whether it was trained
for matryoshka truncation (config.json's `matryoshka_dimensions` or `is_matryoshka`, as vLLM reads them)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from heron.config import ModelSource, PoolerConfig

logger = logging.getLogger(__name__)

_ST_POOLING = "sentence_transformers.models.Pooling"
# sentence-transformers' Pooling config key -> Heron's pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling type of a sentence-transformers folder; None if it is not one (or names no Pooling module).
    A pooling mode Heron does not run (max, weighted mean, ...) is a ValueError naming it."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return None
    config = json.loads((folder / pooling["path"] / "config.json").read_text())
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{folder}'s sentence-transformers pooling is {modes}; Heron pools with one of "
            f"{', '.join(_ST_MODES)} (override with --pooler-config)."
        )
    return _ST_MODES[modes[0]]


def resolve_pooler_config(model: str | ModelSource | None, override: PoolerConfig | None) -> PoolerConfig:
    """The pooler a pooling engine runs: `override`'s fields where set, else the folder's sentence-transformers
    pooling, else LAST (the decoder embedding models' pooling: the last token has seen the whole prompt)."""
    config = override or PoolerConfig()
    if config.pooling_type is None:
        folder = Path(model) if isinstance(model, str) and Path(model).is_dir() else None
        found = sentence_transformers_pooling(folder) if folder is not None else None
        config = PoolerConfig(found or "LAST", config.normalize)
        logger.info(
            "pooling: %s (%s), %snormalised",
            config.pooling_type,
            "sentence-transformers' modules.json" if found else "default for a decoder",
            "" if config.normalize else "not ",
        )
    return config


def as_causal_lm(source: ModelSource) -> ModelSource:
    """A base-model checkpoint (`architectures: ["MistralModel"]`, as e5-mistral is saved: the decoder without
    its LM head) as the causal LM Heron builds: the architecture its model_type names, and an LM head of zeros
    that the pooler never reads. Any other source as it is."""
    arch = (source.hf_config.get("architectures") or ["ForCausalLM"])[0]
    if not arch.endswith("Model"):
        return source
    hf_config = {k: v for k, v in source.hf_config.items() if k != "architectures"}  # (found by model_type)
    weights = source.weights
    vocab, hidden = hf_config["vocab_size"], hf_config["hidden_size"]

    def with_lm_head() -> Iterator[tuple[str, torch.Tensor]]:
        has_head = False
        for name, tensor in weights():
            has_head |= name == "lm_head.weight"
            yield name, tensor
        if not has_head:
            yield "lm_head.weight", torch.zeros(vocab, hidden)

    return dataclasses.replace(source, hf_config=hf_config, weights=with_lm_head)


def matryoshka_dimensions(hf_config: dict) -> list[int] | None:
    """The output sizes a matryoshka model was trained for ([] where it says only `is_matryoshka`); None for
    a model that was not: `dimensions` would cut its embeddings into noise."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims is not None:
        return list(dims)
    return [] if hf_config.get("is_matryoshka") else None
