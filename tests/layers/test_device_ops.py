"""Layers pick their ops when they are built or moved, never per call: on the CPU the PyTorch references, and no
Triton module is imported on the way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

from heron.kernels import reference
from heron.layers.device_ops import DeviceOps
from heron.layers.layernorm import NormLinear, RMSNorm
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear
from heron.layers.rotary import RotaryEmbedding
from heron.layers.vocab_embedding import ParallelLMHead


class _Counted(DeviceOps):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.binds = 0
        self.bind_ops()

    def bind_ops(self) -> None:
        self.binds += 1
        self.device = self.weight.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_ops_are_bound_when_built_and_again_on_every_move_not_per_call():
    outer = torch.nn.Sequential(_Counted())  # moved through its parent, as a model moves its layers
    layer = outer[0]
    assert layer.binds == 1
    for _ in range(3):
        layer(torch.ones(4))
    assert layer.binds == 1
    outer.to(torch.float64)
    assert layer.binds == 2 and layer.weight.dtype == torch.float64
    outer.to("meta")
    assert layer.binds == 3 and layer.device.type == "meta"
    outer.to_empty(device="cpu")  # what the model runner does after building on `meta`
    assert layer.binds == 4 and layer.device.type == "cpu"


def test_on_the_cpu_every_layer_binds_the_pytorch_reference():
    col = ColumnParallelLinear(8, [4, 4], bias=False)
    norm_linear = NormLinear(8, 1e-6, col)
    with torch.device("meta"):  # built on `meta`, moved: bound again for the CPU
        row = RowParallelLinear(8, 4, bias=False, swiglu=True)
    row.to_empty(device="cpu")
    norm, rope, head = RMSNorm(8, 1e-6), RotaryEmbedding(16, 32, 1e4, None), ParallelLMHead(10, 8)
    assert (norm._norm, norm._add_norm) == (reference.rms_norm_ref, reference.fused_add_rms_norm_ref)
    assert norm_linear._norm_linear is reference.rms_norm_linear_ref
    assert col._linear is F.linear and head._linear is F.linear
    assert row._linear is reference.silu_mul_linear_ref
    assert (rope._rope, rope._rope_and_cache) == (reference.apply_rope_ref, reference.apply_rope_and_cache_ref)


def test_a_cpu_forward_imports_no_triton():
    """Built on `meta` and moved as the model runner does, a model runs on the CPU without importing Triton or a
    kernel module (a machine without Triton can run it)."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        from heron.attention.torch_ref import TorchAttentionBackend
        from heron.models.config import TransformerConfig
        from heron.models.registry import get_model_cls
        from tests.models.test_tensor_parallel import _metadata

        hf = dict(architectures=["Qwen3ForCausalLM"], vocab_size=50, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        cfg = TransformerConfig.from_hf(hf)
        with torch.device("meta"):
            model = get_model_cls(cfg.architecture)(cfg, TorchAttentionBackend(2, 1, 16, 0.25))
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "materialize"):
                m.materialize()
        for layer in model.layers:
            layer.self_attn.kv_cache = torch.zeros(2, 24, 4, 1, 16)
        ids, positions, meta = _metadata([[1, 2, 3], [4, 5]], [0, 0])
        with torch.inference_mode():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.1)
            logits = model.compute_logits(model(ids, positions, meta))
        assert logits.shape == (5, 50) and torch.isfinite(logits).all()
        print(sorted(m for m in sys.modules if m.split(".")[0] == "triton"))  # every kernel module imports it
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
