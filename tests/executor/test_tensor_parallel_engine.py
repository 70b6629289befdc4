"""The engine over two tensor-parallel ranks (rank 0 here, one gloo worker process) generates what one
rank does, through chunked prefill (and a step with no logits rows), forks and their copy-on-write, prompt
logprobs and preemption by swapping, also in steps padded to CUDA graphs' counts; a head count that does not
divide is refused before anything starts; a worker that dies stops the engine with its rank and exit code,
before the rendezvous, between steps or inside one, never a hang; shutdown leaves no process behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import pytest

from heron import LLM, SamplingParams
from heron.distributed import get_tp_world_size
from heron.entrypoints.cli import build_parser
from heron.entrypoints.openai.server_config import serve_engine_config
from heron.executor import tp_worker
from heron.executor.graph_keys import GraphKeys

# 12 blocks of 16 tokens for five sequences that grow to ~70 tokens: some are swapped out and back.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, swap_space=0.01)
PROMPTS = [list(range(1000, 1040)), list(range(2000, 2033)), [5, 6, 7, 8, 9] * 8, list(range(300, 337))]


def _kv_memory(arch: str, tp: int) -> int:
    """12 blocks' worth at either size: a rank holds 1/tp of the KV heads."""
    layers, kv_heads, head_dim = 2, 2, 32 if arch == "qwen3" else 16
    return 12 * 2 * layers * 16 * kv_heads // tp * head_dim * 4


def _generate(llm: LLM) -> tuple[list, list]:
    params = [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], outs


def _tp_llm(path: str, arch: str = "llama") -> LLM:
    return LLM(path, kv_cache_memory=_kv_memory(arch, 2), tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_generate_what_one_does(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    one = LLM(path, kv_cache_memory=_kv_memory(arch, 1), **ENGINE)
    expected, expected_outs = _generate(one)
    assert one.engine.stats.num_preemptions > 0
    llm = _tp_llm(path, arch)
    try:
        assert llm.engine.block_manager.num_blocks == one.engine.block_manager.num_blocks == 12
        tokens, outs = _generate(llm)
        assert tokens == expected
        assert llm.engine.stats.num_preemptions == one.engine.stats.num_preemptions
        lp, expected_lp = outs[1].prompt_logprobs, expected_outs[1].prompt_logprobs
        assert len(lp) == len(expected_lp) == len(PROMPTS[1]) and lp[0] is None
        for got, want in zip(lp[1:], expected_lp[1:]):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    finally:
        llm.shutdown()
    assert all(p.exitcode == 0 for p in llm.engine.tp_workers.procs)
    assert get_tp_world_size() == 1


def test_workers_follow_steps_padded_to_graph_counts(tiny_model_dir):
    """Rank 0's steps padded as CUDA graphs run them (no graphs on the CPU: the padded arrays run eagerly on
    every rank, each worker told by the step header which steps are graph steps)."""
    path = tiny_model_dir("llama")
    expected, _ = _generate(LLM(path, kv_cache_memory=_kv_memory("llama", 1), **ENGINE))
    llm = _tp_llm(path)
    try:
        llm.engine.runner.graph_keys = GraphKeys.plan(
            ENGINE["max_num_seqs"], ENGINE["max_num_batched_tokens"], prefill=True
        )
        assert _generate(llm)[0] == expected
    finally:
        llm.shutdown()


def test_heads_that_do_not_divide_are_refused_before_any_worker_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=3, kv_cache_memory=1 << 20)
    assert get_tp_world_size() == 1


def _kill_first_worker(llm: LLM) -> None:
    proc = llm.engine.tp_workers.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    wait([proc.sentinel])  # not join(): the engine reaps its own workers


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(tiny_model_dir, monkeypatch):
    joined = threading.Event()

    def kill_then_join(*args) -> None:  # rank 0's rendezvous, with its worker killed first
        for proc in mp.active_children():
            if proc.name.startswith("heron-tp"):
                os.kill(proc.pid, signal.SIGKILL)
        joined.wait()

    monkeypatch.setattr(tp_worker, "init_distributed", kill_then_join)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 exited with code -9"):
            _tp_llm(tiny_model_dir("llama"))
    finally:
        joined.set()
    assert time.monotonic() - start < 30
    assert not [p for p in mp.active_children() if p.name.startswith("heron-tp")]
    assert get_tp_world_size() == 1


def test_a_worker_that_dies_between_steps_stops_the_engine(tiny_model_dir):
    llm = _tp_llm(tiny_model_dir("llama"))
    try:
        _kill_first_worker(llm)
        for _ in range(2):  # and every later call says the same
            with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 exited with code -9"):
                llm.generate([1, 2, 3], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()
    assert get_tp_world_size() == 1


def test_a_worker_that_dies_inside_a_step_stops_the_engine_without_a_hang(tiny_model_dir):
    llm = _tp_llm(tiny_model_dir("llama"))
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=80, ignore_eos=True), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    try:
        worker = llm.engine.tp_workers.procs[0]
        os.kill(worker.pid, signal.SIGSTOP)  # rank 0's next step waits for it in a collective...
        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.5)
        _kill_first_worker(llm)  # ...and then it dies there
        thread.join(timeout=60)
        assert not thread.is_alive(), "rank 0 hangs after its worker died"
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        assert "tensor-parallel worker rank 1 exited with code -9" in str(errors[0])
    finally:
        llm.shutdown()


def test_serve_takes_the_tensor_parallel_size():
    for flag in ("--tensor-parallel-size", "-tp"):
        args = build_parser().parse_args(["serve", "some/model", flag, "2"])
        assert serve_engine_config(args).parallel.tensor_parallel_size == 2
    assert serve_engine_config(build_parser().parse_args(["serve"])).parallel.tensor_parallel_size == 1
