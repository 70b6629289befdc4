"""Do cuBLASLt's other algorithms run Qwen3-8B's projections faster than its first pick? (GPU)

`python benchmarks/cublaslt_probe.py [--model DIR] [--search] [--table PATH] [rows ...]`. PyTorch's matmul runs cuBLAS's
default or cuBLASLt's first heuristic pick, and its TunableOp registers no other kernel on CUDA
(docs/history/perf_notes.md run 23). This asks cuBLASLt itself (`heron.kernels.gemm.cublaslt`, the engine's
binding) for its heuristic candidates per (shape, rows) and, with `--search`, for every configuration of their
algorithms (tiles x stages x split-K, `CublasLt.search`); it checks each one's product against F.linear and times each
over rotating weight copies (past the L2 cache), against cuBLAS's default and PyTorch's cuBLASLt, all by
`tune.time_on_gpu` (the engine's start-up timer). `--table` writes the searched configurations that beat every
heuristic candidate by 1%, into the table `CublasLt` reads (heron/kernels/gemm/cublaslt_table.json: this GPU model's
entries are replaced, other models' kept). The H200's table came from (run 34)
`python benchmarks/cublaslt_probe.py --search --shapes qkv,o,gate_up,down --table
heron/kernels/gemm/cublaslt_table.json $(seq 64 8 256)`; `--model` takes the projections' shapes from a model
folder's config.json instead of Qwen3-8B's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from heron.kernels.gemm.blas import linear_lt  # noqa: E402
from heron.kernels.gemm.cublaslt import Candidate, CublasLt, table_key  # noqa: E402
from heron.kernels.gemm.tune import CANDIDATE_MARGIN, MAX_REL_ERR, time_on_gpu  # noqa: E402

QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
SHAPE_NAMES = ("qkv", "o", "gate_up", "down", "lm_head")
ROWS = (32, 64, 128, 192, 200, 256)
CHUNK = 16  # calls timed behind one sleep kernel (a longer queue would outrun the sleep)
SCREEN_CHUNK, FINALISTS = 64, 8  # the search's first pass (one round, half the copies), then its best 8 in full


def shapes_of(config: dict) -> dict[str, tuple[int, int, int]]:
    """A decoder's matmuls by name: (N, K, how many a decode step runs)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config.get("num_key_value_heads", config["num_attention_heads"]) * d
    inter = config["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, h, layers),
        "o": (h, q, layers),
        "gate_up": (2 * inter, h, layers),
        "down": (h, inter, layers),
        "lm_head": (config["vocab_size"], h, 1),
    }


def _correct(
    lt: CublasLt, cands: list[Candidate], x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ref: torch.Tensor
) -> list[Candidate]:
    kept = []
    for cand in cands:
        try:
            y.fill_(float("nan"))
            lt.matmul(x, w, y, cand)
        except RuntimeError:
            continue
        if ((y.float() - ref).abs().max() / ref.abs().max()).item() < MAX_REL_ERR:  # (NaN fails too)
            kept.append(cand)
    return kept


def _times(
    lt: CublasLt,
    cands: list[Candidate],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    y: torch.Tensor,
    chunk: int = CHUNK,
    rounds: int = 3,
) -> list[float]:
    """Seconds per call of each candidate (over one weight copy), in chunks."""
    out = []
    for i in range(0, len(cands), chunk):
        calls = [lambda a, w, c=c: lt.matmul(a, w, y, c) for c in cands[i : i + chunk]]
        out += [t / len(weights) for t in time_on_gpu(calls, weights, x, rounds)]
    return out


def _finalists(
    lt: CublasLt,
    found: list[Candidate],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    y: torch.Tensor,
    ref: torch.Tensor,
) -> tuple[list[Candidate], list[float]]:
    """The searched configurations' fastest few by a quick first pass, checked, then timed in full."""
    quick = _times(lt, found, x, weights[: max(1, len(weights) // 2)], y, SCREEN_CHUNK, rounds=1)
    best = _correct(
        lt, [found[i] for i in sorted(range(len(found)), key=quick.__getitem__)[:FINALISTS]], x, weights[0], y, ref
    )
    return best, _times(lt, best, x, weights, y)


def main(
    rows: tuple[int, ...], config: dict, names: list[str], search: bool, all_algos: bool, table_path: str | None
) -> None:
    dev = torch.device("cuda")
    lt = CublasLt(dev)
    every_algo = lt.algo_ids(torch.bfloat16, torch.bfloat16)
    algo_ids = every_algo if all_algos else None
    print(
        torch.cuda.get_device_name(),
        torch.__version__,
        f"cuBLASLt {lt.version}, {len(every_algo)} algorithms for bf16",
        flush=True,
    )
    step = {m: [0.0, 0.0, 0.0, 0.0] for m in rows}  # cuBLAS, the better library, + heuristic candidates, + searched
    entries = []
    shapes = shapes_of(config)
    for name in names:
        n, k, count = shapes[name]
        copies = max(1, min(8, (256 << 20) // (2 * n * k)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16  # the LM head's logits are float32
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=out_dtype)
            ref = F.linear(x.float(), weights[0].float())
            libs = (
                [lambda a, w: torch.mm(a, w.t(), out_dtype=torch.float32)]
                if name == "lm_head"
                else [F.linear, linear_lt]
            )
            t_libs = [t / copies for t in time_on_gpu(libs, weights, x)]
            heur = _correct(lt, lt.candidates(m, n, k, torch.bfloat16, out_dtype), x, weights[0], y, ref)
            t_heur = _times(lt, heur, x, weights, y)
            best_h = min([*t_heur, float("inf")])
            line = (
                f"{name:8s} M={m:4d}: cuBLAS {t_libs[0] * 1e6:7.1f}  "
                + (f"torch-Lt {t_libs[1] * 1e6:7.1f}  " if len(t_libs) > 1 else "")
                + f"heuristic best {best_h * 1e6:7.1f} of {len(heur)}"
            )
            before = best_all = min(best_h, *t_libs)  # the best the engine had without a search
            if search:
                start = time.perf_counter()
                found = lt.search(m, n, k, torch.bfloat16, out_dtype, algo_ids)
                good, t_s = _finalists(lt, found, x, weights, y, ref)
                line += f"  searched {len(found)} in {time.perf_counter() - start:.1f} s"
                if good:
                    i = min(range(len(good)), key=t_s.__getitem__)
                    config = lt.config(good[i])
                    line += f", best {t_s[i] * 1e6:7.1f} x{before / t_s[i]:.3f}: {config}"
                    best_all = min(best_all, t_s[i])
                    if t_s[i] < CANDIDATE_MARGIN * before:
                        entries.append(
                            {
                                "key": table_key(m, n, k, torch.bfloat16, out_dtype),
                                "config": config,
                                "us": round(t_s[i] * 1e6, 2),
                                "us_before": round(before * 1e6, 2),
                            }
                        )
                        if table_path:  # after each problem: a run cut short keeps what it found
                            _write(table_path, lt, entries)
            print(line, flush=True)
            for j, v in enumerate((t_libs[0], min(t_libs), before, best_all)):
                step[m][j] += count * v
        del weights
    print("one decode step's matmuls, ms: cuBLAS / better library / + heuristic candidates / + searched")
    for m, v in step.items():
        print(f"  M={m:5d}: " + " ".join(f"{t * 1e3:7.2f}" for t in v) + f"  x{v[2] / v[3]:.3f}")
    if table_path:
        print(f"{len(entries)} entries written to {table_path}")


def _write(path: str, lt: CublasLt, entries: list[dict]) -> None:
    """This GPU model's table in the file at `path`, replacing its previous one; the problems it did not search
    keep their entries."""
    device = torch.cuda.get_device_name()
    tables = json.load(open(path)) if os.path.exists(path) else []
    mine = next((t for t in tables if t["device"] == device), {"entries": []})
    merged = {e["key"]: e for e in mine["entries"]} | {e["key"]: e for e in entries}
    tables = [t for t in tables if t["device"] != device]
    tables.append({"device": device, "cublaslt": lt.version, "entries": sorted(merged.values(), key=_order)})
    with open(path, "w") as f:
        json.dump(tables, f, indent=1)
        f.write("\n")


def _order(entry: dict) -> tuple:
    m, rest = entry["key"].split("x", 1)
    return rest, int(m)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", type=int)
    ap.add_argument("--model", help="a model folder: its config.json's shapes (default: Qwen3-8B's)")
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES), help=f"of {', '.join(SHAPE_NAMES)}")
    ap.add_argument("--search", action="store_true", help="also every configuration of the heuristic's algorithms")
    ap.add_argument("--all-algos", action="store_true", help="search every algorithm cuBLASLt has (slower)")
    ap.add_argument("--table", help="write the searched winners here (JSON)")
    a = ap.parse_args()
    config = json.load(open(os.path.join(a.model, "config.json"))) if a.model else QWEN3_8B
    main(tuple(a.rows) or ROWS, config, a.shapes.split(","), a.search, a.all_algos, a.table)
