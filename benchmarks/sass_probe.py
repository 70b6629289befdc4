"""The attention kernels compiled for the H100 / H200 (sm_90a) on this machine's CPU, no GPU needed: Triton's
front end, LLVM, and the ptxas, cuobjdump and nvdisasm it carries (the wheel's; the device image's Triton may
carry another ptxas: compare like with like, or run this there too). For each case (CASES: the prefill and
decode kernels' variants) it prints the cubin's registers, stack (spills live there) and static shared memory,
the SASS's instruction count and its loops (backward branches), each with its instructions, MMAs, local-memory
loads and stores (LDL / STL: spills), global loads and the 16-byte asynchronous copies (LDGSTS ... 128) that
stream K and V into shared memory. It shows what a change does to the code before a device
call times it; what the code costs on the GPU it does not say.

    python benchmarks/sass_probe.py ["prefill, 1" ...]   (cases whose names start so; default all)

Not under TRITON_INTERPRET=1: the kernels would be the interpreter's (its test runs it in a process of its own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from heron.kernels import paged_decode, paged_prefill

TARGET = GPUTarget("cuda", 90, 32)
PTXAS, NVDISASM, CUOBJDUMP = knobs.nvidia.ptxas, knobs.nvidia.nvdisasm, knobs.nvidia.cuobjdump  # Triton's own
POINTERS = dict(bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", order_ptr="*i32", kv_start_ptr="*i32")
POINTERS |= dict(count_ptr="*i32", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16")
POINTERS |= {f"{n}_ptr": "*fp32" for n in ("part_o", "part_lse", "part_m", "part_l", "prefix_o", "prefix_lse")}
# Qwen3-0.6B's heads (GQA 2), D 128, bf16, 16-token blocks, each kernel's default tiles and launch options
HEADS = dict(G=2, HEAD_DIM=128, BLOCK_SIZE=16, UPCAST=False, PRECISION="tf32", WINDOW=0, SOFT_CAP=0.0, FP8=False)
PREFILL = HEADS | dict(G_PAD=2, BLOCK_M=128, BLOCK_N=32, SKIP_DECODE=True, MIN_TILES=16, PDL=True)
DECODE = HEADS | dict(NUM_HEADS=16, NUM_KV_HEADS=8, G_PAD=16, USE_QSL=False, HAS_ORDER=True, HEADS_FIRST=True)
DECODE |= dict(LO_MASK=False, PREFIX_PARTS=0, PDL=True, BLOCK_N=128, NUM_PARTS=2, PARTS_PAD=2)
# (what, kernel, constexprs, launch options): the prefill with one program a query tile and with its keys
# shared among 4; the decode of a full batch (2 partitions, 128-key tiles) and with the 64-key tiles of smaller
# batches
CASES = [
    ("prefill, 1 share a tile", paged_prefill._paged_prefill_kernel, PREFILL | dict(SPLITS=1), dict(maxnreg=128)),
    ("prefill, 4 shares a tile", paged_prefill._paged_prefill_kernel, PREFILL | dict(SPLITS=4), dict(maxnreg=128)),
    ("decode, batch 256", paged_decode._paged_decode_kernel, DECODE, dict(num_warps=4)),
    ("decode, 64-key tiles", paged_decode._paged_decode_kernel, DECODE | dict(BLOCK_N=64), dict(num_warps=4)),
]


def compile_sm90(fn: triton.JITFunction, constexprs: dict, floats: set[str], **options) -> dict[str, str]:
    """`fn` compiled for sm_90a with these constexprs (pointer arguments as POINTERS types them, `floats` fp32,
    the rest i32): Triton's asm dict (ttir ... ptx, cubin). Every pointer and every `stride*` argument carries
    the divisibility by 16 a launch gives it (a torch allocation's 16-byte alignment; the strides of the cache,
    q and the block tables are multiples of 16): without it Triton cannot prove a row's 16-byte alignment and
    loads K and V two bytes at a time (the figures sessions 24-25 read, 32 registers and 3,199 spill
    instructions for the full batch's decode, were that build, not the GPU's)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "fp32" if n in floats else "i32") for n in names}
    hinted = [i for i, n in enumerate(names) if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride"))]
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in hinted},
    )
    return triton.compile(src, target=TARGET, options=options).asm


def _tool_output(tool: knobs.NvidiaTool, cubin: bytes, *args: str) -> str:
    """What one of Triton's CUDA tools prints for the cubin Triton built (not a second build of its PTX)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool.path, *args, path], capture_output=True, text=True, check=True).stdout


def usage(cubin: bytes) -> str:
    """The kernel's registers, stack (spills live there) and static shared memory, as its cubin records them."""
    found = dict(re.findall(r"\b(REG|STACK|SHARED):(\d+)", _tool_output(CUOBJDUMP, cubin, "--dump-resource-usage")))
    return f"Used {found['REG']} registers, {found['STACK']} bytes of stack, {found['SHARED']} bytes of static shared"


def sass(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """The cubin's SASS: (address, instruction) rows and each label's address."""
    rows, labels, pending = [], {}, []
    for line in _tool_output(NVDISASM, cubin, "-c").splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line):
            addr = int(m.group(1), 16)
            labels.update((label, addr) for label in pending)
            pending = []
            rows.append((addr, m.group(2)))
    return rows, labels


def count(rows: list[tuple[int, str]], opcode: str) -> int:
    """How many of the rows' instructions match the `opcode` pattern."""
    return sum(bool(re.search(opcode, text)) for _, text in rows)


def loops(rows: list[tuple[int, str]], labels: dict[str, int]) -> list[str]:
    """A line per loop (a branch back to an earlier label): its span and what its body holds."""
    out = []
    for addr, text in rows:
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        start = labels.get(m.group(1), addr) if m else addr
        if start < addr:
            body = [(a, t) for a, t in rows if start <= a <= addr]
            ops = (r"\bHG?MMA", r"\bLDL", r"\bSTL", r"\bLDG(?!STS|DEPBAR)", r"\bLDGSTS\S*\.128")
            mma, ldl, stl, ldg, cp = (count(body, op) for op in ops)
            out.append(
                f"loop {start:#x}-{addr:#x}: {len(body)} instructions, {mma} MMA, {ldl} LDL, {stl} STL, {ldg} LDG, "
                f"{cp} LDGSTS.128"
            )
    return out


def main(only: list[str]) -> None:
    """Every case, or those whose names start with one of `only`."""
    print(f"ptxas {PTXAS.version} ({PTXAS.path})")
    for what, kernel, constexprs, options in CASES:
        if only and not any(what.startswith(prefix) for prefix in only):
            continue
        asm = compile_sm90(kernel, constexprs, {"qk_scale", "v_scale"}, **{"num_warps": 8, "num_stages": 3} | options)
        rows, labels = sass(asm["cubin"])
        spills = count(rows, r"\b(LDL|STL)\b")
        print(f"{what}: {usage(asm['cubin'])}\n  {len(rows)} SASS instructions, {spills} of them LDL / STL")
        for line in loops(rows, labels):
            print("  " + line)


if __name__ == "__main__":
    main(sys.argv[1:])
