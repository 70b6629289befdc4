"""Do cuBLASLt's other heuristic candidates run Qwen3-8B's projections faster than its first pick? (GPU)

`python benchmarks/cublaslt_probe.py [rows ...]`. PyTorch's matmul runs cuBLAS's default or cuBLASLt's first
heuristic pick (`heron/models/blas.py` chooses between the two), and its TunableOp registers no other kernel on
CUDA (docs/perf_notes.md run 23). This asks cuBLASLt itself, through ctypes (no compiled extension), for up to
REQUESTED candidate algorithms per (shape, rows), checks each one's product against F.linear, and times each by
CUDA-graph replay over rotating weight copies (past the L2 cache), against cuBLAS's default and PyTorch's
cuBLASLt. If the best candidates beat both at 100-256 rows, `blas.py` can choose among them (the call works in
a captured graph: one cublasLtMatmul on the current stream, workspace preallocated).

y = x @ W.T with row-major x [M, K], W [N, K], y [M, N] is, in cuBLAS's column-major terms, y^T [N, M] =
op_T(W) [N, K] x x^T [K, M]: A = W (K x N, ld K, transposed), B = x (K x M, ld K), C = D = y (N x M, ld N).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from heron.kernels.bench import _time_graph  # noqa: E402
from heron.models.blas import linear_lt  # noqa: E402

SHAPES = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
          "lm_head": (151936, 4096, 1)}  # name: (N, K, per decode step)
ROWS = (32, 64, 128, 192, 200, 256)
REQUESTED = 32  # candidates asked of cublasLtMatmulAlgoGetHeuristic
WORKSPACE = 32 << 20
# cublasLt.h / cublas_api.h / library_types.h (CUDA 13)
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load() -> ctypes.CDLL:
    """The libcublasLt that PyTorch loaded (by its soname), else one from the nvidia wheels."""
    torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # PyTorch has loaded cuBLAS(Lt) now
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for path in sys.path:
        for lib in glob.glob(os.path.join(path, "nvidia", "*", "lib", "libcublasLt.so*")):
            return ctypes.CDLL(lib)
    raise OSError("libcublasLt not found")


class Lt:
    """One cuBLASLt handle and y = x @ W.T problems on it."""

    def __init__(self) -> None:
        self.lib = lib = _load()
        P, I, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t  # (size_t and 64-bit ints are never passed as int)
        for fn, args in (("cublasLtCreate", [P]), ("cublasLtMatmulDescCreate", [P, I, I]),
                         ("cublasLtMatmulDescSetAttribute", [P, I, P, S]), ("cublasLtMatmulPreferenceCreate", [P]),
                         ("cublasLtMatmulPreferenceSetAttribute", [P, I, P, S]),
                         ("cublasLtMatrixLayoutCreate", [P, I, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
                         ("cublasLtMatmulAlgoGetHeuristic", [P] * 7 + [I, P, P]),
                         ("cublasLtMatmul", [P] * 14 + [S, P])):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, I
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            self._check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "transpose")
        self.pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES,
                                                                  ctypes.byref(size), 8), "workspace size")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cublasStatus {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return layout

    def problem(self, m: int, n: int, k: int) -> tuple:
        """(A, B, C) layouts of y [m, n] = x [m, k] @ W[n, k].T, and the heuristic's candidates for them."""
        a, b, c = self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n)
        results, count = (Heuristic * REQUESTED)(), ctypes.c_int()
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, self.pref, REQUESTED,
                                                            results, ctypes.byref(count)), "heuristic")
        return (a, b, c), [results[i] for i in range(count.value) if results[i].state == 0]

    def matmul(self, layouts: tuple, cand: Heuristic, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        a, b, c = layouts
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), w.data_ptr(), a, x.data_ptr(), b, ctypes.byref(self.beta),
            y.data_ptr(), c, y.data_ptr(), c, ctypes.byref(cand.algo), self.workspace.data_ptr(),
            min(cand.workspaceSize, WORKSPACE), stream), "cublasLtMatmul")


def main(rows: tuple[int, ...]) -> None:
    lt, dev = Lt(), torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, f"cuBLASLt candidates (up to {REQUESTED}) per problem")
    step = {m: [0.0, 0.0, 0.0] for m in rows}  # cuBLAS default, PyTorch's cuBLASLt, best candidate
    for name, (n, k, count) in SHAPES.items():
        copies = max(1, min(8, (400 << 20) // (2 * n * k)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            t = [_time_graph(lambda: [call(x, w) for w in weights], iters=1) / copies for call in (F.linear, linear_lt)]
            layouts, cands = lt.problem(m, n, k)
            timed = []
            for i, cand in enumerate(cands):
                try:
                    y.fill_(float("nan"))
                    lt.matmul(layouts, cand, x, weights[0], y)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:  # (NaN fails too)
                        print(f"    candidate {i}: wrong product (rel err {err:.3g}), skipped")
                        continue
                    t_cand = _time_graph(lambda: [lt.matmul(layouts, cand, x, w, y) for w in weights], iters=1)
                    timed.append((t_cand / copies, i, cand.wavesCount, cand.workspaceSize))
                except RuntimeError as e:
                    print(f"    candidate {i}: {e}")
            timed.sort()
            best = timed[0][0] if timed else float("inf")
            for j, v in enumerate((t[0], t[1], min(best, t[0], t[1]))):
                step[m][j] += count * v
            top = ", ".join(f"#{i} {s * 1e6:.1f} us (waves {wv:.2f}, ws {ws >> 10} KiB)" for s, i, wv, ws in timed[:3])
            print(f"{name:8s} M={m:5d}: cuBLAS {t[0] * 1e6:8.1f}  torch-Lt {t[1] * 1e6:8.1f}  "
                  f"{len(cands)} candidates, best x{min(t) / best:.3f} vs the better of the two: {top}")
    print("one decode step of Qwen3-8B's matmuls, ms: cuBLAS / PyTorch's cuBLASLt / best of all")
    for m, (a, b, c) in step.items():
        print(f"  M={m:5d}: {a * 1e3:7.2f} {b * 1e3:7.2f} {c * 1e3:7.2f}  x{min(a, b) / c:.3f}")


if __name__ == "__main__":
    main(tuple(int(r) for r in sys.argv[1:]) or ROWS)
