"""Cascade (shared-prefix) decode attention against the plain paged decode kernel and the PyTorch reference, over
random group structures planned by heron/attention/cascade.py: members at different lengths, a member whose
table matches its group's only partly, sequences in no group, padded rows; the plan recomputed after a member
leaves; a mixed step's decode rows beside prompt chunks. Under the interpreter on the CPU (tiny shapes) or on the
GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from heron.attention.cascade import CascadePlanner  # noqa: E402
from heron.kernels.cascade import (  # noqa: E402
    _cascade_prefix_kernel,
    cascade_prefix_attention,
    make_prefix_workspace,
    tile_seqs,
)
from heron.kernels.paged_decode import make_decode_workspace, paged_decode_attention  # noqa: E402
from heron.kernels.reference import paged_decode_ref  # noqa: E402
from tests.kernels.kernel_utils import assert_close, pick_device, skip_unless_runnable  # noqa: E402

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
skip_unless_runnable(_cascade_prefix_kernel, DEVICE)


def _structure(rng: np.random.Generator, block_size: int, num_groups: int, group_size: int, loners: int, prefix=(4, 8)):
    """Block tables and lengths: `num_groups` groups sharing [low, high) `prefix` blocks, each member its own blocks
    after them (different lengths); in each group one member shares only the first 4 blocks (a partial match); then
    `loners` sequences of their own and one padded row (length 0). Tables are filled with junk past their blocks."""
    tables, lens, next_block = [], [], 0

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    for _ in range(num_groups):
        shared = fresh(int(rng.integers(*prefix)))
        for i in range(group_size):
            own = shared if i else shared[:4]  # member 0: a partial match
            extra = int(rng.integers(1, 3 * block_size))
            lens.append(len(own) * block_size + extra)
            tables.append(own + fresh(-(-extra // block_size)))
    for _ in range(loners):
        n = int(rng.integers(1, 6 * block_size))
        lens.append(n)
        tables.append(fresh(-(-n // block_size)))
    lens.append(0)
    tables.append([])
    order = rng.permutation(len(lens))
    width = max(map(len, tables)) + 2
    out = rng.integers(0, next_block, size=(len(lens), width)).astype(np.int32)  # junk past each table
    for row, i in enumerate(order):
        out[row, : len(tables[i])] = tables[i]
    return out, np.array(lens, dtype=np.int32)[order], next_block


def _run(tables, lens, num_blocks, heads, head_dim, block_size, parts, dtype, seed, block_m=16):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    b = len(lens)
    q = torch.randn(b, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    bt = torch.from_numpy(tables).to(DEVICE)
    sl = torch.from_numpy(lens).to(DEVICE)
    scale = head_dim**-0.5
    seqs = tile_seqs(num_heads, num_kv_heads, block_m=block_m)
    planner = CascadePlanner(b, seqs, block_size, 1, min_group=2, min_prefix_blocks=2, min_saved_bytes=1)
    groups = planner.groups(tables, lens)
    packed = np.zeros(planner.size, dtype=np.int32)
    planner.write(packed, b, groups)
    kv_start, tile_len, members = planner.views(torch.from_numpy(packed).to(DEVICE), b)
    ws = make_prefix_workspace(b, num_heads, head_dim, DEVICE, parts=3)
    block_n = None if ON_GPU else 16
    prefix = cascade_prefix_attention(q, cache, bt, tile_len, members, scale, ws, block_n=block_n)
    plain_ws = make_decode_workspace(b, num_heads, num_kv_heads, head_dim, parts, DEVICE) if parts > 1 else None
    out = paged_decode_attention(
        q, cache, bt, sl, scale, out=torch.full_like(q, float("nan")), num_partitions=parts, block_n=block_n,
        workspace=plain_ws, kv_start=kv_start, prefix=prefix,
    )  # fmt: skip
    plain = paged_decode_attention(q, cache, bt, sl, scale, num_partitions=parts, block_n=block_n)
    return out, plain, paged_decode_ref(q, cache, bt, sl, scale), groups


@pytest.mark.parametrize(
    "heads,head_dim,block_size,parts,dtype",
    [((4, 2), 32, 16, 1, torch.float32), ((8, 2), 64, 16, 2, torch.bfloat16), ((2, 2), 32, 32, 3, torch.bfloat16)],
)
def test_cascade_matches_plain_decode(heads, head_dim, block_size, parts, dtype):
    rng = np.random.default_rng(head_dim + block_size + parts)
    tables, lens, num_blocks = _structure(rng, block_size, num_groups=2, group_size=5, loners=2)
    out, plain, ref, groups = _run(tables, lens, num_blocks, heads, head_dim, block_size, parts, dtype, seed=parts)
    assert len(groups) == 2 and all(len(m) >= 4 for m, _ in groups)  # the structure did group
    assert_close(out, plain, dtype, "cascade vs plain decode")
    assert_close(out, ref.to(dtype), dtype, "cascade vs reference")
    assert out[int(np.flatnonzero(lens == 0)[0])].abs().max() == 0  # the padded row


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (large shapes)")
@pytest.mark.parametrize("heads,parts", [((16, 8), 1), ((32, 8), 2)])
def test_cascade_production_shapes(heads, parts):
    """Qwen3-0.6B's and -8B's heads, D 128, bf16, 64-row tiles: groups of 24 sharing ~2,000 prefix keys."""
    rng = np.random.default_rng(parts)
    tables, lens, num_blocks = _structure(rng, 16, num_groups=4, group_size=24, loners=16, prefix=(110, 130))
    out, plain, ref, groups = _run(tables, lens, num_blocks, heads, 128, 16, parts, torch.bfloat16, seed=1, block_m=64)
    assert len(groups) == 4
    assert_close(out, plain, torch.bfloat16, "cascade vs plain decode")
    assert_close(out, ref, torch.bfloat16, "cascade vs reference")


def test_cascade_after_a_member_leaves():
    """A finished member is gone from the next step's batch: the plan is recomputed from the remaining tables
    (the other members one key longer) and still matches the plain kernel."""
    rng = np.random.default_rng(7)
    tables, lens, num_blocks = _structure(rng, 16, num_groups=1, group_size=4, loners=1)
    grouped = np.flatnonzero((lens > 0) & (tables[:, 0] == np.bincount(tables[lens > 0, 0]).argmax()))
    keep = np.setdiff1d(np.arange(len(lens)), grouped[-1:])
    tables, lens = tables[keep], lens[keep] + (lens[keep] > 0)
    out, plain, _, groups = _run(tables, lens, num_blocks + 4, (4, 2), 32, 16, 2, torch.float32, seed=3)
    assert groups
    assert_close(out, plain, torch.float32, "cascade vs plain decode after a member left")


def test_cascade_in_a_mixed_step():
    """Decode rows beside prompt chunks (query_start_loc): the prefix kernel reads each member's one query row,
    prompt rows are in no group (planned with length 0, as CascadeBuffers.plan does) and left to the prefill
    kernel; the decode rows equal the plain mixed-step decode kernel's."""
    rng = np.random.default_rng(11)
    tables, lens, num_blocks = _structure(rng, 16, num_groups=2, group_size=5, loners=2)
    b = len(lens)
    q_lens = np.ones(b, dtype=np.int32)
    grouped = np.flatnonzero(lens > 16 * 4)
    q_lens[grouped[::4]] = 3  # a few would-be members are prompt chunks this step
    qsl_np = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    heads, head_dim, dtype = (4, 2), 32, torch.float32
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, num_blocks, 16, heads[1], head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(int(qsl_np[-1]), heads[0], head_dim, generator=gen).to(DEVICE, dtype)
    bt, sl, qsl = (torch.from_numpy(a).to(DEVICE) for a in (tables, lens, qsl_np))
    planner = CascadePlanner(
        b, tile_seqs(*heads, block_m=16), 16, 1, min_group=2, min_prefix_blocks=2, min_saved_bytes=1
    )
    groups = planner.groups(tables, np.where(q_lens == 1, lens, 0))
    members = np.concatenate([m for m, _ in groups])
    assert len(groups) == 2 and not np.isin(np.flatnonzero(q_lens > 1), members).any()
    packed = np.zeros(planner.size, dtype=np.int32)
    planner.write(packed, b, groups)
    kv_start, tile_len, tile_members = planner.views(torch.from_numpy(packed).to(DEVICE), b)
    ws = make_prefix_workspace(b, heads[0], head_dim, DEVICE, parts=2)
    kw = dict(block_n=None if ON_GPU else 16)
    prefix = cascade_prefix_attention(
        q, cache, bt, tile_len, tile_members, head_dim**-0.5, ws, query_start_loc=qsl, **kw
    )
    out = paged_decode_attention(
        q, cache, bt, sl, head_dim**-0.5, out=torch.full_like(q, float("nan")), query_start_loc=qsl,
        kv_start=kv_start, prefix=prefix, **kw,
    )  # fmt: skip
    plain = paged_decode_attention(q, cache, bt, sl, head_dim**-0.5, query_start_loc=qsl, **kw)
    rows = torch.from_numpy(qsl_np[:-1][q_lens == 1]).to(DEVICE).long()
    assert_close(out[rows], plain[rows], dtype, "cascade vs plain decode rows of a mixed step")


def test_planner_rules():
    """Groups need enough members and prefix blocks; a partial match lowers the prefix only where that pays;
    a step that saves too little runs plain."""
    planner = CascadePlanner(16, 4, 16, 4096, min_group=3, min_prefix_blocks=2, min_saved_bytes=0)
    shared = list(range(10))
    tables = np.array(
        [shared + [100 + i] for i in range(4)]  # 4 members: 10 shared blocks
        + [shared[:3] + [200, 201, 202, 203, 204, 205, 206, 207]]  # a partial match: 3 blocks
        + [[300 + i for i in range(11)] for _ in range(2)],  # two strangers
        dtype=np.int32,
    )
    lens = np.array([11 * 16] * 7, dtype=np.int32)
    ((members, blocks),) = planner.groups(tables, lens)
    assert sorted(members.tolist()) == [0, 1, 2, 3] and blocks == 10  # 3 x 10 beats 4 x 3
    lens[:3] = 3 * 16 + 1  # three members now short: the 5 sharing 3 blocks pay more (4 x 3 vs 0)
    ((members, blocks),) = planner.groups(tables, lens)
    assert sorted(members.tolist()) == [0, 1, 2, 3, 4] and blocks == 3
    assert CascadePlanner(16, 4, 16, 4096, min_group=6).groups(tables, lens) == []  # groups too small
    assert CascadePlanner(16, 4, 16, 4096, min_group=3, min_saved_bytes=1 << 30).groups(tables, lens) == []
    packed = np.zeros(planner.size, dtype=np.int32)
    planner.write(packed, 7, planner.groups(tables, lens))
    kv_start, tile_len, tile_members = planner.views(packed, 7)
    assert kv_start.tolist() == [48] * 5 + [0, 0]
    assert tile_len.tolist()[:2] == [48, 48] and not tile_len[2:].any()
    assert sorted(tile_members[:2].reshape(-1).tolist()) == [-1, -1, -1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("eager", [False, True] if DEVICE.type == "cuda" else [False])
def test_engine_greedy_same_with_and_without_cascade(tiny_model_dir, monkeypatch, eager):
    """Requests sharing a system prompt, through the engine on the Triton backend: greedy outputs with cascade
    attention equal those without, and the cascade ran, in decode steps and in mixed ones. The first request
    fills the prefix cache; the others then share its blocks, at different lengths; one finishes early (the
    steps after it plan without it) and the last, admitted in its place (four at a time), prefills beside the
    others' decode rows. On a GPU, with CUDA graphs and without: there a mixed step of at most 8 sequences
    replays a small-step graph, which has no cascade variant (executor/graph_keys.py), so only the eager
    engine's mixed steps run one."""
    from heron import LLM, SamplingParams
    from heron.attention import cascade as plan
    from heron.inputs import TokensPrompt

    monkeypatch.setattr(plan, "MIN_SAVED_BYTES", 0)  # a tiny model's prefix saves few bytes, but does save
    monkeypatch.setattr(plan, "MIN_PREFIX_BLOCKS", 2)
    monkeypatch.setattr(plan, "MIN_GROUP", 2)
    grouped = []  # per planned step (not a graph's capture): (runs as a cascade, is a mixed step)
    plan_step = plan.CascadeBuffers.plan

    def spy(self, meta, force):
        grouped.append((plan_step(self, meta, force) and not meta.cascade, meta.max_query_len > 1))
        return grouped[-1][0] or force

    monkeypatch.setattr(plan.CascadeBuffers, "plan", spy)
    rng = np.random.default_rng(0)
    system = rng.integers(100, 5000, 48).tolist()  # 3 blocks of 16
    prompts = [TokensPrompt(prompt_token_ids=system + rng.integers(100, 5000, 2 + 5 * i).tolist()) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens={0: 1, 2: 2}.get(i, 5), ignore_eos=True) for i in range(6)]
    outputs = {}
    for disable in (False, True):
        llm = LLM(
            tiny_model_dir("qwen3"), device=DEVICE.type, dtype="float32", attention_backend="triton",
            disable_cascade_attn=disable, kv_cache_memory=32 << 20, max_num_seqs=4, enforce_eager=eager,
        )  # fmt: skip
        first = llm.generate(prompts[:1], params[0], use_tqdm=False)
        rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
        outputs[disable] = [o.outputs[0].token_ids for o in first + rest]
        assert any(cascade for cascade, _ in grouped) != disable
        if eager or DEVICE.type != "cuda":
            assert any(cascade and mixed for cascade, mixed in grouped) != disable
        grouped.clear()
    assert outputs[False] == outputs[True]
