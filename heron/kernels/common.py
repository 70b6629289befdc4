"""Helpers the kernels and their wrappers share."""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_upcast() -> bool:
    """Whether kernels should feed tl.dot float32 operands. Only under the interpreter: its tl.dot on
    bfloat16 operands returns garbage (numpy has no bfloat16), and numpy's float16 matmul is slow. On a GPU
    the operands stay in the cache dtype (tensor cores)."""
    return interpreting()


_starting: weakref.WeakSet = weakref.WeakSet()  # runners between `compiles_expected` and `warn_late_compiles`
_late_logger: logging.Logger | None = None
_previous_hook = None  # the post-compile hook set before ours, called after it


def compiles_expected(runner: object) -> None:
    """`runner` starts up: until its `warn_late_compiles` the kernels Triton compiles are its start-up's, not
    warned of (an engine started after another in one process compiles its own variants). A runner whose
    start-up failed drops out of the set when it is collected."""
    _starting.add(runner)


def warn_late_compiles(runner: object, logger: logging.Logger) -> None:
    """`runner`'s start-up has run every step shape it plans (its warm-up). From now on, while no other runner
    of this process starts up, log a warning whenever Triton compiles a kernel (or loads one from its disk
    cache): a variant no start-up step reached (a new constexpr or a specialization of an integer argument,
    such as a multiple of 16, or 1), and the step that needs it stalls for the compile, ~1 s. A hook set before
    (the user's) is still called."""
    global _late_logger, _previous_hook
    _starting.discard(runner)
    _late_logger = logger
    if triton.knobs.runtime.jit_post_compile_hook is not _late_compile_hook:
        _previous_hook = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = _late_compile_hook


def _late_compile_hook(**kwargs) -> None:
    """Triton's post-compile hook (its keyword arguments: key, repr, fn, compile, is_manual_warmup, ...)."""
    if not _starting and _late_logger is not None:
        _late_logger.warning(
            "Triton compiled %s after start-up, stalling this step (a variant the warm-up did not reach): %.300s",
            kwargs["fn"].name,
            kwargs["key"],
        )
    if _previous_hook is not None:
        _previous_hook(**kwargs)


def check_cache(kv_cache: torch.Tensor) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
    )
    assert kv_cache.stride(-1) == 1, "kv_cache needs a contiguous head_dim"
    head_dim, block_size = kv_cache.shape[-1], kv_cache.shape[2]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}"


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def _pdl(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip or interpreting() or os.environ.get("HERON_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


PDL_MIN_ROWS = 1  # every launch (a variant: see pdl_options)


def pdl_options(device: torch.device, rows: int) -> dict:
    """Launch arguments for programmatic dependent launch (sm_90+; HERON_PDL=0 turns it off): the kernel's PDL
    flag and Triton's launch_pdl. Such a kernel is let onto the SMs while the stream's previous kernel finishes,
    instead of after it: in a decode step of ~360 short kernels the launch gaps add up (offline Qwen3-8B +0.4-0.8%,
    docs/history/perf_notes.md run 31). For launches over at least PDL_MIN_ROWS rows (tokens or sequences). A
    batch-1 step is a chain of ~8 short kernels a layer, each paying its launch; run 32 found it slower with every
    kernel so (Llama-3.1-8B 4.71 ms a token against 4.17) when the GEMV let the next kernel launch at its start,
    which it now does after its main loop (heron/kernels/gemv.py)."""
    return dict(PDL=True, launch_pdl=True) if rows >= PDL_MIN_ROWS and _pdl(device) else dict(PDL=False)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement under `pdl_options`: wait until the previous kernel has finished and its
    writes are visible (before any load or store, so no program can touch memory early, nor exit before the
    wait: the kernel's end then implies its predecessor's), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def tanh(x):
    """tanh of float32 x from exp2 and a division, on the GPU and under the interpreter alike (libdevice's tanh
    has no interpreter version): sign(x) (1 - 2t / (1 + t)), t = e^(-2|x|). Near +-1 it is within an ulp or so of
    the correctly rounded value, so 1 + tanh(x) keeps the digits PyTorch's GELU keeps (GeGLU's bf16 outputs round
    as F.gelu's); near 0 it is within ~1e-7 absolute."""
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # e^(-2|x|): 2 log2(e)
    r = 1.0 - 2.0 * t / (1.0 + t)
    return tl.where(x >= 0, r, -r)


@triton.jit
def to_fp8(x, inv_scale, dst_ptr, FIX_FP8: tl.constexpr):
    """x / scale, clamped to float8 e4m3's +-448 (a plain cast past it gives NaN), in dst_ptr's float8 type.
    FIX_FP8 (under the interpreter, whose float32 -> e4m3 cast rounds ties away from zero and drops the carry
    of a mantissa that rounds up into the exponent: 7.9 -> 4): round to nearest even on the bits first, so the
    cast is exact. On a GPU it is one cvt.rn.satfinite."""
    y = x.to(tl.float32) * inv_scale
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if FIX_FP8:
        u = y.to(tl.int32, bitcast=True)
        normal = ((u + (0x7FFFF + ((u >> 20) & 1))) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        subnormal = ((y * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # multiples of 2**-9 (1.5 * 2**23)
        y = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
    return y.to(dst_ptr.dtype.element_ty)
