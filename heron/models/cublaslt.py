"""cuBLASLt's matmul through ctypes, for the algorithms PyTorch does not offer.

PyTorch runs cuBLAS's default kernel or cuBLASLt's first heuristic pick, and its TunableOp registers no other
kernel on CUDA (torch 2.11). cuBLASLt's heuristic lists several candidates for a problem, and at the skinny
row counts of a decode step another one is often faster than its first pick: on an H200, Qwen3-8B's o
projection at 200 rows 17.7 -> 16.2 us, down at 192 rows 42.8 -> 39.0, the LM head at 64 rows 352 -> 302
(docs/perf_notes.md run 26). `heron/models/blas.py` times the candidates and keeps the fastest; this module
only asks for them and runs one. No compiled extension: the library PyTorch already loaded, called directly.

y = x @ W.T with row-major x [M, K], W [N, K], y [M, N] is, in cuBLAS's column-major terms,
y^T [N, M] = op_T(W) [N, K] x x^T [K, M]: A = W (K x N, ld K, transposed), B = x (K x M, ld K), C = D = y
(N x M, ld N). One cublasLtMatmul on the current stream: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

import torch

# cublasLt.h, cublas_api.h, library_types.h (CUDA 12 and 13)
_DATA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 256  # bytes: the heuristic's default assumption about every matrix's address


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t: opaque, 64 bytes


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True, eq=False)
class Candidate:
    """One of the heuristic's algorithms for one problem (its layouts: the row count is part of it)."""
    algo: _Algo
    workspace: int  # bytes it needs
    rank: int  # its place in the heuristic's list (0: PyTorch's cuBLASLt pick)
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A, B, C = D


def _load() -> ctypes.CDLL:
    """The libcublasLt PyTorch loaded (found by its soname once PyTorch has run a matmul), else one from the
    nvidia wheels on sys.path."""
    torch.zeros(1, 1, device="cuda") @ torch.zeros(1, 1, device="cuda")
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for path in sys.path:
        for lib in sorted(glob.glob(os.path.join(path, "nvidia", "**", "libcublasLt.so*"), recursive=True)):
            return ctypes.CDLL(lib)
    raise OSError("libcublasLt not found")


class CublasLt:
    """A cuBLASLt handle and a workspace on one device. The workspace is shared by every call: the engine
    runs its matmuls on one stream at a time (two streams at once would need one each)."""

    def __init__(self, device: torch.device) -> None:
        self.lib = lib = _load()
        P, I, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        for fn, args in (("cublasLtCreate", [P]), ("cublasLtMatmulDescCreate", [P, I, I]),
                         ("cublasLtMatmulDescSetAttribute", [P, I, P, S]), ("cublasLtMatmulPreferenceCreate", [P]),
                         ("cublasLtMatmulPreferenceSetAttribute", [P, I, P, S]),
                         ("cublasLtMatrixLayoutCreate", [P, I, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
                         ("cublasLtMatmulAlgoGetHeuristic", [P] * 7 + [I, P, P]),
                         ("cublasLtMatmul", [P] * 14 + [S, P])):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, I
        with torch.cuda.device(device):
            self.handle = self._create(lib.cublasLtCreate)
        self.desc = self._create(lib.cublasLtMatmulDescCreate, _COMPUTE_32F, _DATA_TYPE[torch.float32])
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            self._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(ctypes.c_int32(op)), 4))
        self.pref = self._create(lib.cublasLtMatmulPreferenceCreate)
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES,
                                                             ctypes.byref(size), 8))
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt call failed: cublasStatus_t {status}")

    def _create(self, fn, *args) -> ctypes.c_void_p:
        obj = ctypes.c_void_p()
        self._check(fn(ctypes.byref(obj), *args))
        return obj

    def _layout(self, dtype: torch.dtype, rows: int, cols: int) -> ctypes.c_void_p:
        return self._create(self.lib.cublasLtMatrixLayoutCreate, _DATA_TYPE[dtype], ctypes.c_uint64(rows),
                            ctypes.c_uint64(cols), ctypes.c_int64(rows))

    def candidates(self, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype,
                   count: int = 8) -> list[Candidate]:
        """The heuristic's algorithms for y [m, n] (out_dtype) = x [m, k] @ W [n, k].T (dtype), best first."""
        layouts = (self._layout(dtype, k, n), self._layout(dtype, k, m), self._layout(out_dtype, n, m))
        results, found = (_Heuristic * count)(), ctypes.c_int()
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, *layouts, layouts[2], self.pref,
                                                            count, results, ctypes.byref(found)))
        return [Candidate(results[i].algo, results[i].workspaceSize, i, layouts)
                for i in range(found.value) if results[i].state == 0]

    @staticmethod
    def fits(*matrices: torch.Tensor) -> bool:
        """Whether the matrices are laid out as the candidates assumed: contiguous, aligned."""
        return all(t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in matrices)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cand: Candidate) -> torch.Tensor:
        """out [m, n] = x [m, k] @ weight [n, k].T with `cand` (found for exactly these shapes and dtypes)."""
        a, b, c = cand.layouts
        self._check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), weight.data_ptr(), a, x.data_ptr(), b,
            ctypes.byref(self.beta), out.data_ptr(), c, out.data_ptr(), c, ctypes.byref(cand.algo),
            self.workspace.data_ptr(), cand.workspace, torch.cuda.current_stream(x.device).cuda_stream))
        return out
