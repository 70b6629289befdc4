"""The routed experts of a sparse mixture-of-experts MLP (Mixtral, Qwen-MoE), all in two stacked weights.

Each expert is a SwiGLU MLP; `w13_weight` [E, 2I, H] holds every expert's [gate | up] rows and `w2_weight`
[E, H, I] its down projection, so that one grouped GEMM per projection runs all experts at once on CUDA
(heron/kernels/fused_moe.py: routing, sorting by expert, the GEMMs and the combine, with no host sync), and the
PyTorch reference (one matmul pair per expert with tokens) elsewhere. The router is the model's (a
`ReplicatedLinear`); this layer takes its logits.

Tensor parallelism splits every expert's intermediate dim, as the dense MLP's gate/up columns and down rows are
split: each rank holds [its gate | its up] rows and its down columns of all E experts, computes a partial sum of
each token's output, and one all-reduce adds them.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.distributed import get_tp_rank, get_tp_world_size, tensor_model_parallel_all_reduce
from heron.kernels.reference import fused_moe_ref
from heron.layers.device_ops import DeviceOps
from heron.layers.linear import check_shape, divide


class FusedMoE(DeviceOps):
    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.local_inter = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_inter))
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.w13_weight.is_cuda:
            from heron.kernels.fused_moe import fused_moe

            self._moe = fused_moe
        else:
            self._moe = fused_moe_ref

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> the weighted sum of each token's top-k experts [T, H]."""
        out = self._moe(x, router_logits, self.w13_weight, self.w2_weight, self.top_k, self.renormalize)
        return out if self.tp_size == 1 else tensor_model_parallel_all_reduce(out)

    def shard_ids(self, param: torch.Tensor) -> list[tuple[int, int]]:
        """The (expert, part) matrices a checkpoint fills `param` from: gate 0 and up 1 of w13, down 0 of w2."""
        parts = 2 if param is self.w13_weight else 1
        return [(e, p) for e in range(self.num_experts) for p in range(parts)]

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        """`loaded_weight`: one expert's full matrix (shard_id (expert, part): gate or up [I, H] of w13, down
        [H, I] of w2), or every expert's stacked (None: [E, 2I, H] of [gate | up] rows, or [E, H, I])."""
        experts, hidden, inter, local = self.num_experts, self.hidden_size, self.intermediate_size, self.local_inter
        if shard_id is None:
            if param is self.w13_weight:
                check_shape(loaded_weight, experts, 2 * inter, hidden)
                shards = {(e, p): m for e in range(experts) for p, m in enumerate(loaded_weight[e].split(inter))}
            else:
                check_shape(loaded_weight, experts, hidden, inter)
                shards = {(e, 0): loaded_weight[e] for e in range(experts)}
            for shard, matrix in shards.items():
                self.weight_loader(param, matrix, shard)
            return
        expert, part = shard_id
        if not 0 <= expert < experts:
            raise ValueError(f"is expert {expert}, and the model has {experts}.")
        if param is self.w13_weight:
            check_shape(loaded_weight, inter, hidden)
            rows = loaded_weight.narrow(0, self.tp_rank * local, local)
            param.data[expert].narrow(0, part * local, local).copy_(rows)
        else:
            check_shape(loaded_weight, hidden, inter)
            param.data[expert].copy_(loaded_weight.narrow(1, self.tp_rank * local, local))
