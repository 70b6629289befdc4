"""cuBLASLt's matmul through ctypes, for the algorithms PyTorch does not offer.

PyTorch runs cuBLAS's default kernel or cuBLASLt's first heuristic pick, and its TunableOp registers no other
kernel on CUDA (torch 2.11). cuBLASLt's heuristic lists several candidates for a problem, and at the skinny
row counts of a decode step another one is often faster than its first pick: on an H200, Qwen3-8B's o
projection at 200 rows 17.7 -> 16.2 us, down at 192 rows 42.8 -> 39.0, the LM head at 64 rows 352 -> 302
(docs/history/perf_notes.md run 26). `tune.py` times the candidates and keeps the fastest; this module only asks for
them and runs one (its search over more configurations serves benchmarks/cublaslt_probe.py). No compiled
extension: the library PyTorch already loaded, called directly.

y = x @ W.T with row-major x [M, K], W [N, K], y [M, N] is, in cuBLAS's column-major terms,
y^T [N, M] = op_T(W) [N, K] x x^T [K, M]: A = W (K x N, ld K, transposed), B = x (K x M, ld K), C = D = y
(N x M, ld N). One cublasLtMatmul on the current stream: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import glob
import json
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
_CAP_SPLITK, _CAP_REDUCTION_MASK, _CAP_TILE_IDS, _CAP_STAGES_IDS = 0, 1, 6, 13  # cublasLtMatmulAlgoCapAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t: a configuration's fields (attribute, C type)
CONFIG_FIELDS = {
    "id": (0, ctypes.c_int32),
    "tile": (1, ctypes.c_uint32),
    "splitk": (2, ctypes.c_uint32),
    "reduction": (3, ctypes.c_uint32),
    "swizzle": (4, ctypes.c_uint32),
    "custom": (5, ctypes.c_uint32),
    "stages": (6, ctypes.c_uint32),
    "inner": (7, ctypes.c_uint16),
    "cluster": (8, ctypes.c_uint16),
}
SEARCH_SPLIT_K = (1, 2, 3, 4)
TABLE = os.path.join(os.path.dirname(__file__), "cublaslt_table.json")  # searched configurations, per GPU model
WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 256  # bytes: the heuristic's default assumption about every matrix's address


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t: opaque, 64 bytes


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass(frozen=True, eq=False)
class Candidate:
    """One of the heuristic's algorithms for one problem (its layouts: the row count is part of it)."""

    algo: _Algo
    workspace: int  # bytes it needs
    rank: int  # its place in the heuristic's list (0: PyTorch's cuBLASLt pick; -1: not the heuristic's)
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


def table_key(m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    return f"{m}x{n}x{k}:{str(dtype).removeprefix('torch.')}:{str(out_dtype).removeprefix('torch.')}"


def _table(device_name: str, path: str = TABLE) -> dict[str, dict[str, int]]:
    """The searched configurations recorded for this GPU model ({} for none): {table_key: config}."""
    try:
        with open(path) as f:
            tables = json.load(f)
    except FileNotFoundError:
        return {}
    return {e["key"]: e["config"] for t in tables if t["device"] == device_name for e in t["entries"]}


class CublasLt:
    """A cuBLASLt handle and a workspace on one device. The workspace is shared by every call: the engine
    runs its matmuls on one stream at a time (two streams at once would need one each)."""

    def __init__(self, device: torch.device) -> None:
        self.lib = lib = _load()
        P, I, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t  # noqa: E741 (the C types, one letter each)
        for fn, args in (
            ("cublasLtCreate", [P]),
            ("cublasLtMatmulDescCreate", [P, I, I]),
            ("cublasLtMatmulDescSetAttribute", [P, I, P, S]),
            ("cublasLtMatmulPreferenceCreate", [P]),
            ("cublasLtMatmulPreferenceSetAttribute", [P, I, P, S]),
            ("cublasLtMatrixLayoutCreate", [P, I, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
            ("cublasLtMatmulAlgoGetHeuristic", [P] * 7 + [I, P, P]),
            ("cublasLtMatmulAlgoGetIds", [P] + [I] * 7 + [P, P]),
            ("cublasLtMatmulAlgoInit", [P] + [I] * 7 + [P]),
            ("cublasLtMatmulAlgoCheck", [P] * 8),
            ("cublasLtMatmulAlgoCapGetAttribute", [P, I, P, S, P]),
            ("cublasLtMatmulAlgoConfigGetAttribute", [P, I, P, S, P]),
            ("cublasLtMatmulAlgoConfigSetAttribute", [P, I, P, S]),
            ("cublasLtMatmul", [P] * 14 + [S, P]),
        ):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, I
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = lib.cublasLtGetVersion()
        self.table = _table(torch.cuda.get_device_name(device))
        with torch.cuda.device(device):
            self.handle = self._create(lib.cublasLtCreate)
        self.desc = self._create(lib.cublasLtMatmulDescCreate, _COMPUTE_32F, _DATA_TYPE[torch.float32])
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            self._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(ctypes.c_int32(op)), 4))
        self.pref = self._create(lib.cublasLtMatmulPreferenceCreate)
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self._check(
            lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8)
        )
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
        return self._create(
            self.lib.cublasLtMatrixLayoutCreate,
            _DATA_TYPE[dtype],
            ctypes.c_uint64(rows),
            ctypes.c_uint64(cols),
            ctypes.c_int64(rows),
        )

    def _layouts(
        self, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype
    ) -> tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]:
        return self._layout(dtype, k, n), self._layout(dtype, k, m), self._layout(out_dtype, n, m)

    def candidates(
        self, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype, count: int = 8
    ) -> list[Candidate]:
        """The heuristic's algorithms for y [m, n] (out_dtype) = x [m, k] @ W [n, k].T (dtype), best first, then
        the configuration this GPU model's table records for the problem (a search's winner), if cuBLASLt
        accepts it here."""
        layouts = self._layouts(m, n, k, dtype, out_dtype)
        results, found = (_Heuristic * count)(), ctypes.c_int()
        self._check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, self.desc, *layouts, layouts[2], self.pref, count, results, ctypes.byref(found)
            )
        )
        cands = [
            Candidate(results[i].algo, results[i].workspaceSize, i, layouts)
            for i in range(found.value)
            if results[i].state == 0
        ]
        config = self.table.get(table_key(m, n, k, dtype, out_dtype))
        recorded = config and self._recorded(layouts, config, dtype, out_dtype)
        return cands + [recorded] if recorded else cands

    def _recorded(
        self, layouts: tuple, config: dict[str, int], dtype: torch.dtype, out_dtype: torch.dtype
    ) -> Candidate | None:
        """A table's configuration, if this cuBLASLt has its algorithm and accepts it (a table is per GPU model,
        not per library version)."""
        try:
            base = self._init(config["id"], dtype, out_dtype)
        except RuntimeError:
            return None
        return self._accepted(layouts, base, config)

    def config(self, cand: Candidate) -> dict[str, int]:
        """The configuration an algorithm was built with (what a table records)."""
        out = {}
        for name, (attr, ctype) in CONFIG_FIELDS.items():
            value = ctype()
            written = ctypes.c_size_t()
            self._check(
                self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                    ctypes.byref(cand.algo), attr, ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written)
                )
            )
            out[name] = value.value
        return out

    def search(
        self,
        m: int,
        n: int,
        k: int,
        dtype: torch.dtype,
        out_dtype: torch.dtype,
        algo_ids: list[int] | None = None,
        split_k: tuple[int, ...] = SEARCH_SPLIT_K,
    ) -> list[Candidate]:
        """Every configuration cuBLASLt accepts for this problem among each algorithm's tiles x stages x
        `split_k` (with the first reduction scheme it supports), and the cluster and inner shapes its heuristic
        candidates use; `algo_ids`: the algorithms (None: those of the heuristic's candidates). The heuristic
        lists at most 8 (it returned 8 when asked for 32): this is the space they come from, for a tuning run
        to time (benchmarks/cublaslt_probe.py --search)."""
        layouts = self._layouts(m, n, k, dtype, out_dtype)
        seen = [self.config(c) for c in self.candidates(m, n, k, dtype, out_dtype)]
        shapes = sorted({(c["cluster"], c["inner"]) for c in seen} | {(0, 0)})
        found = []
        for algo_id in sorted({c["id"] for c in seen}) if algo_ids is None else algo_ids:
            algo = self._init(algo_id, dtype, out_dtype)
            splits = split_k if self._cap(algo, _CAP_SPLITK)[0] else (1,)
            scheme = self._cap(algo, _CAP_REDUCTION_MASK)[0]
            scheme &= -scheme  # its lowest bit: the first scheme it supports
            for tile in self._cap(algo, _CAP_TILE_IDS) or [0]:
                for stages in self._cap(algo, _CAP_STAGES_IDS) or [0]:
                    for splitk in splits:
                        for cluster, inner in shapes:
                            config = {
                                "id": algo_id,
                                "tile": tile,
                                "stages": stages,
                                "splitk": splitk,
                                "reduction": scheme if splitk > 1 else 0,
                                "cluster": cluster,
                                "inner": inner,
                            }
                            cand = self._accepted(layouts, algo, config)
                            if cand is not None:
                                found.append(cand)
        return found

    def algo_ids(self, dtype: torch.dtype, out_dtype: torch.dtype) -> list[int]:
        """Every algorithm cuBLASLt has for these types."""
        ids, count = (ctypes.c_int * 1024)(), ctypes.c_int()
        types = _DATA_TYPE[dtype], _DATA_TYPE[dtype], _DATA_TYPE[out_dtype], _DATA_TYPE[out_dtype]
        self._check(
            self.lib.cublasLtMatmulAlgoGetIds(
                self.handle, _COMPUTE_32F, _DATA_TYPE[torch.float32], *types, len(ids), ids, ctypes.byref(count)
            )
        )
        return list(ids[: count.value])

    def _init(self, algo_id: int, dtype: torch.dtype, out_dtype: torch.dtype) -> _Algo:
        algo = _Algo()
        types = _DATA_TYPE[dtype], _DATA_TYPE[dtype], _DATA_TYPE[out_dtype], _DATA_TYPE[out_dtype]
        self._check(
            self.lib.cublasLtMatmulAlgoInit(
                self.handle, _COMPUTE_32F, _DATA_TYPE[torch.float32], *types, algo_id, ctypes.byref(algo)
            )
        )
        return algo

    def _cap(self, algo: _Algo, attr: int) -> list[int]:
        """A capability of the algorithm: a list of uint32 (one value for the scalar ones)."""
        size = ctypes.c_size_t()
        self._check(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)))
        values = (ctypes.c_uint32 * max(1, size.value // 4))()
        self._check(
            self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, size.value, ctypes.byref(size))
        )
        return list(values[: size.value // 4])

    def _accepted(self, layouts: tuple, base: _Algo, config: dict[str, int]) -> Candidate | None:
        """A copy of `base` set to `config`, if cuBLASLt accepts it for the problem within the workspace."""
        algo = _Algo.from_buffer_copy(base)
        for name, value in config.items():
            attr, ctype = CONFIG_FIELDS[name]
            if (
                name != "id"
                and self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                    ctypes.byref(algo), attr, ctypes.byref(ctype(value)), ctypes.sizeof(ctype)
                )
                != 0
            ):
                return None
        result = _Heuristic()
        if (
            self.lib.cublasLtMatmulAlgoCheck(
                self.handle, self.desc, *layouts, layouts[2], ctypes.byref(algo), ctypes.byref(result)
            )
            != 0
            or result.workspaceSize > WORKSPACE_BYTES
        ):
            return None
        return Candidate(algo, result.workspaceSize, -1, layouts)

    @staticmethod
    def fits(*matrices: torch.Tensor) -> bool:
        """Whether the matrices are laid out as the candidates assumed: contiguous, aligned."""
        return all(t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in matrices)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cand: Candidate) -> torch.Tensor:
        """out [m, n] = x [m, k] @ weight [n, k].T with `cand` (found for exactly these shapes and dtypes)."""
        a, b, c = cand.layouts
        self._check(
            self.lib.cublasLtMatmul(
                self.handle,
                self.desc,
                ctypes.byref(self.alpha),
                weight.data_ptr(),
                a,
                x.data_ptr(),
                b,
                ctypes.byref(self.beta),
                out.data_ptr(),
                c,
                out.data_ptr(),
                c,
                ctypes.byref(cand.algo),
                self.workspace.data_ptr(),
                cand.workspace,
                torch.cuda.current_stream(x.device).cuda_stream,
            )
        )
        return out


_handles: dict[int, CublasLt] = {}  # per device index, made once


def handle(device: torch.device) -> CublasLt | None:
    """The device's cuBLASLt handle (made on first use), or None off CUDA or where the library cannot be loaded."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        try:
            _handles[index] = CublasLt(torch.device("cuda", index))
        except OSError:
            return None
    return _handles[index]
