"""The paged prefill kernel compiled for the H100 / H200 (sm_90a) on this machine's CPU, no GPU needed: Triton's
front end, LLVM, and the ptxas and nvdisasm its wheel bundles. For each variant (one program a query tile, or its
keys shared among 4 programs) it prints ptxas's registers and spill bytes, the SASS's instruction count and its
loops (backward branches), each with its instructions, MMAs, local-memory loads and stores (LDL / STL: spills)
and global loads. It shows what a change does to the code before a device call times it; what the code costs on
the GPU it does not say.

    python benchmarks/sass_probe.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from heron.kernels import paged_prefill

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# Qwen3-0.6B's heads (GQA 2), D 128, bf16, 16-token blocks, the default tiles (paged_prefill.default_prefill_config)
PREFILL = dict(G=2, G_PAD=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=32, SKIP_DECODE=True, UPCAST=False)
PREFILL |= dict(PRECISION="tf32", WINDOW=0, SOFT_CAP=0.0, FP8=False, MIN_TILES=16, PDL=True)
POINTERS = dict(bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32")
POINTERS |= dict(count_ptr="*i32", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16")


def compile_sm90(fn: triton.JITFunction, constexprs: dict, floats: set[str], **options) -> dict[str, str]:
    """`fn` compiled for sm_90a with these constexprs (pointer arguments as POINTERS types them, `floats` fp32,
    the rest i32): Triton's asm dict (ttir ... ptx, cubin)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "fp32" if n in floats else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=options).asm


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's registers and spill line for `ptx`."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(d, "k.o")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return "; ".join(line.split(":", 1)[-1].strip() for line in out.splitlines() if "spill" in line or "Used" in line)


def sass(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """The cubin's SASS: (address, instruction) rows and each label's address."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    rows, labels, pending = [], {}, []
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line):
            addr = int(m.group(1), 16)
            labels.update((label, addr) for label in pending)
            pending = []
            rows.append((addr, m.group(2)))
    return rows, labels


def count(rows: list[tuple[int, str]], opcode: str) -> int:
    return sum(bool(re.search(opcode, text)) for _, text in rows)


def loops(rows: list[tuple[int, str]], labels: dict[str, int]) -> list[str]:
    """A line per loop (a branch back to an earlier label): its span and what its body holds."""
    out = []
    for addr, text in rows:
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        start = labels.get(m.group(1), addr) if m else addr
        if start < addr:
            body = [(a, t) for a, t in rows if start <= a <= addr]
            mma, ldl, stl, ldg = (count(body, op) for op in (r"\bHG?MMA", r"\bLDL", r"\bSTL", r"\bLDG"))
            out.append(
                f"loop {start:#x}-{addr:#x}: {len(body)} instructions, {mma} MMA, {ldl} LDL, {stl} STL, {ldg} LDG"
            )
    return out


def main() -> None:
    for splits in (1, 4):
        asm = compile_sm90(
            paged_prefill._paged_prefill_kernel,
            PREFILL | dict(SPLITS=splits),
            {"qk_scale", "v_scale"},
            num_warps=8,
            num_stages=3,
            maxnreg=128,
        )
        rows, labels = sass(asm["cubin"])
        print(f"paged prefill, {splits} share(s) a tile: {ptxas_usage(asm['ptx'])}")
        spills = count(rows, r"\b(LDL|STL)\b")
        print(f"  {len(rows)} SASS instructions, {spills} of them LDL / STL")
        for line in loops(rows, labels):
            print("  " + line)


if __name__ == "__main__":
    main()
