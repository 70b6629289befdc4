"""Random paged batches for the kernel tests (imported by the test modules of this folder)."""

from __future__ import annotations

import math

import torch

from heron.attention.backend import AttentionMetadata


def pick_device() -> torch.device:
    import os

    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.device("cuda" if torch.cuda.is_available() and not interp else "cpu")


def skip_unless_runnable(kernel, device: torch.device) -> None:
    """Skip the calling test module on a CPU where `kernel` was compiled for a GPU rather than wrapped by
    the interpreter: heron.kernels was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1."""
    import pytest

    if device.type != "cuda" and type(kernel).__name__ != "InterpretedFunction":
        pytest.skip(
            "no GPU and the kernels were not decorated under TRITON_INTERPRET=1 (heron.kernels was "
            "imported before tests/kernels/conftest.py set it)",
            allow_module_level=True,
        )


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
    device: torch.device,
    gen: torch.Generator,
    extra_blocks: int = 7,
    pad_cols: int = 2,
) -> AttentionMetadata:
    """Sequences with shuffled, non-contiguous blocks (a random permutation of the pool), block-table
    columns past each sequence's blocks filled with random (valid) block ids that must never be read,
    and slots for the last q_len positions of each sequence."""
    assert len(seq_lens) == len(q_lens) and all(0 <= q <= s for s, q in zip(seq_lens, q_lens))
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(needed, default=0) + pad_cols
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, q_lens)):
        for p in range(s - q, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_seqs=len(seq_lens),
        num_tokens=int(qsl[-1]),
        query_start_loc=qsl.to(device),
        seq_lens=sl.to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=sl,
        block_tables_cpu=tables,
    )
    meta.num_blocks = num_blocks  # for the caller's cache size
    return meta


def make_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# Relative (Frobenius) error bound and elementwise atol per dtype: the kernels round P to the cache dtype
# before the P @ V product, as flash attention does.
TOL = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (4e-3, 6e-3), torch.float32: (1e-4, 1e-4)}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a row left unwritten?)"
    rel_tol, atol = TOL[dtype]
    err = rel_err(out, ref)
    assert err < rel_tol, f"{what}: relative error {err:.3g} >= {rel_tol}"
    max_abs = (out.float() - ref.float()).abs().max().item()
    assert max_abs < atol + rel_tol * ref.float().abs().max().item(), f"{what}: max abs error {max_abs:.3g}"


def random_adapters(num_slots: int, in_size: int, out_sizes: list[int], max_rank: int, ranks: list[int], gen):
    """LoRA A and B (float32, CPU) as LoRAStack holds them: slot s of rank ranks[s], each part's rows past it
    zero, B block-diagonal (part p's rank rows feed only its output columns)."""
    parts = len(out_sizes)
    a = torch.zeros(num_slots, parts * max_rank, in_size)
    b = torch.zeros(num_slots, parts * max_rank, sum(out_sizes))
    for s, r in enumerate(ranks):
        for p, n in enumerate(out_sizes):
            rows, col = slice(p * max_rank, p * max_rank + r), sum(out_sizes[:p])
            a[s, rows] = torch.randn(r, in_size, generator=gen) / in_size**0.5
            b[s, rows, col : col + n] = torch.randn(r, n, generator=gen)
    return a, b
