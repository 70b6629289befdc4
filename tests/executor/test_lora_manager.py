"""The LoRA manager's device mapping: what the gathered kernels read before and after a step's prepare."""

from __future__ import annotations

import numpy as np
import torch

from heron.attention.torch_ref import TorchAttentionBackend
from heron.config import LoRAConfig
from heron.executor.lora_manager import LoRAManager, group_by_slot
from heron.models.config import TransformerConfig
from heron.models.registry import get_model_cls


def _tiny_model() -> torch.nn.Module:
    hf = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    cfg = TransformerConfig.from_hf(hf)
    return get_model_cls(cfg.architecture)(cfg, TorchAttentionBackend(2, 1, cfg.head_dim, cfg.head_dim**-0.5))


def test_the_mapping_lists_every_row_before_any_step_and_after_each():
    """Before any prepare (the start-up's profiling and compile steps run the model without one) every row is the
    base model's and listed in order: the kernel that adds gate/up's delta inside the activation reads the row of
    each index (an unset -1 read the row before the output's first, an illegal address on the GPU). A step's
    prepare then lists its rows by slot, the base model's last."""
    manager = LoRAManager(_tiny_model(), LoRAConfig(enable_lora=True, max_loras=2), 8, torch.device("cpu"))
    m = manager.mapping
    assert m.token_slots.tolist() == [-1] * 8
    assert m.sorted_tokens.tolist() == list(range(8)) and m.slot_start.tolist() == [0, 0, 0]
    manager.gathered = True  # as on the GPU, where the kernels read the grouped rows
    manager.prepare([], [1, -1, 0], np.array([0, 0, 1, 2, 2]), 6)
    order, starts = group_by_slot(np.array([1, 1, -1, 0, 0, -1]), 2)
    assert m.token_slots[:6].tolist() == [1, 1, -1, 0, 0, -1]
    assert m.sorted_tokens[:6].tolist() == order.tolist() == [3, 4, 0, 1, 2, 5]
    assert m.slot_start.tolist() == starts.tolist() == [0, 2, 4]
