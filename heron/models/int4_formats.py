"""Int4 weight-only checkpoints converted, tensor by tensor as they stream in, to Heron's one layout
(heron/kernels/gemm/int4.py): `weight` int32 [N, K/8] (K's nibbles in order), `weight_scale` float32 [N, K/G],
`weight_zero_point` uint8 [N, K/G]; w = (q - zero) * scale. Each format's own tensors:

- AWQ (AutoAWQ's GEMM layout): `qweight` int32 [K, N/8] packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7]
  (nibble j of a word holds column ORDER[j]), `qzeros` int32 [K/G, N/8] packed the same, `scales` [K/G, N].
- GPTQ: `qweight` int32 [K/8, N] packed along K in order (so its transpose is Heron's), `qzeros` int32
  [K/G, N/8] packed along N in order, stored minus 1 (mod 16) in the v1 `checkpoint_format` "gptq" and as they
  are in "gptq_v2", `scales` [K/G, N], `g_idx` [K] (checked to be the trivial k // G, then dropped).
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K/8] (values offset by 8, in order: Heron's
  layout as it is), `weight_scale` [N, K/G], `weight_zero_point` int32 [N/8, K/G] packed along N (offset by 8
  too, so it reads as an unsigned zero), `weight_shape` (dropped). Symmetric: no zero point, the zero is 8.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from heron.kernels.reference import pack_int4, unpack_int4

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of an AWQ word sits in nibble AWQ_REVERSE_ORDER[j]
_Converted = tuple[str, torch.Tensor] | tuple[()] | None  # (Heron's leaf name, tensor); () drops it; None: as is


def int4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], method: str, group_size: int, gptq_v1: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream (Hugging Face names) with each int4 tensor renamed and converted to Heron's layout;
    every other tensor (a 16-bit layer the format left alone, norms, biases) as it is."""
    convert = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}[method]
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        try:
            converted = convert(leaf, tensor, group_size, gptq_v1)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        if converted is None:
            yield name, tensor
        elif converted:
            yield f"{module}.{converted[0]}", converted[1]


def _awq(leaf: str, t: torch.Tensor, group_size: int, gptq_v1: bool) -> _Converted:
    if leaf == "qweight":
        return "weight", pack_int4(unpack_int4(t, AWQ_REVERSE_ORDER).t())
    if leaf == "qzeros":
        return "weight_zero_point", unpack_int4(t, AWQ_REVERSE_ORDER).t().contiguous()
    if leaf == "scales":
        return "weight_scale", t.t().float().contiguous()
    return None


def _gptq(leaf: str, t: torch.Tensor, group_size: int, gptq_v1: bool) -> _Converted:
    if leaf == "qweight":
        return "weight", t.t().contiguous()
    if leaf == "qzeros":
        zeros = unpack_int4(t)
        return "weight_zero_point", ((zeros + 1) & 0xF if gptq_v1 else zeros).t().contiguous()
    if leaf == "scales":
        return "weight_scale", t.t().float().contiguous()
    if leaf == "g_idx":
        k = t.shape[0]
        if not torch.equal(t.long(), torch.arange(k) // (k if group_size == -1 else group_size)):
            raise ValueError("g_idx is not the sequential k // group_size (act-order weights are not supported).")
        return ()
    return None


def _compressed_tensors(leaf: str, t: torch.Tensor, group_size: int, gptq_v1: bool) -> _Converted:
    if leaf == "weight_packed":
        return "weight", t
    if leaf == "weight_scale":
        return "weight_scale", t.float()
    if leaf == "weight_zero_point":
        return "weight_zero_point", unpack_int4(t.t()).t().contiguous()
    if leaf == "weight_shape":
        return ()
    return None
