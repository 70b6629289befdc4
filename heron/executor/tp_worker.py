"""Tensor parallelism over processes: the engine's process is rank 0 and keeps its own ModelRunner; it
spawns one worker process per other rank (`TPWorkers`), and each worker builds the same runner over
its slices of the model on its device and runs every step rank 0 sends (heron/executor/step_broadcast.py).

A worker that dies takes the engine down with an error that names it, never a hang: rank 0 checks the
workers before each step and turns a failed step into that error (gloo's collectives fail as soon as
a peer's socket closes); with NCCL, where a collective waiting for a dead peer never returns, a
watcher thread aborts the communicators. Workers leave with rank 0: its pipe closes, or, inside a
collective, a thread sees the parent's exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from heron.config import EngineConfig
from heron.distributed import destroy_distributed, init_distributed
from heron.executor.model_runner import ModelRunner
from heron.executor.step_broadcast import HEADER_LEN, Msg, Pipes, StepSender, header
from heron.models.config import TransformerConfig
from heron.models.loader import load_configured

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long one collective may wait for the other ranks; a backstop for a rank that hangs while alive
# (a rank that exits is noticed at once).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
_JOIN_TIMEOUT_S = 5.0  # for a worker to leave after being told to, before it is killed
# NVLink multicast (NVLS) stays off, as the GPU hosts we are lent require.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TPWorkers:
    """Rank 0's handle on the worker processes of ranks 1..N-1."""

    def __init__(self, config: EngineConfig, model_cfg: TransformerConfig, device: torch.device) -> None:
        size = config.parallel.tensor_parallel_size
        _check(size, model_cfg, device)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if self.backend == "nccl":
            for key, value in _NCCL_ENV.items():  # before any NCCL call; the workers inherit them
                os.environ.setdefault(key, value)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, torch.get_num_threads() // size)  # on the CPU, ranks share the cores
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        conns: list[Connection] = []
        self.error: str | None = None  # set once: the engine cannot run without every rank
        self._closing = False
        self._reaping = threading.Lock()  # of two threads waiting for one child, one would miss its exit code
        atexit.register(self.shutdown)
        self.pipes = Pipes(conns)
        try:
            for rank in range(1, size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"heron-tp{rank}",
                    daemon=True,
                    args=(rank, size, init_method, self.backend, config, reader, threads),
                )
                proc.start()
                reader.close()  # only the worker holds the read end: its EOF then means rank 0 is gone
                self.procs.append(proc)
                conns.append(writer)
            self._join_group(lambda: init_distributed(0, size, init_method, self.backend, COLLECTIVE_TIMEOUT))
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._watch, name="heron-tp-watch", daemon=True).start()

    def _join_group(self, join) -> None:
        """Rank 0 joins the group in a thread while this one watches the workers: one that died before
        joining would leave the rendezvous waiting for the whole timeout."""
        failure: list[BaseException] = []
        thread = threading.Thread(target=lambda: _capture(join, failure), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self.check()
        if failure:
            raise failure[0]

    def fewest_blocks(self, num_blocks: int, device: torch.device) -> int:
        """Each rank's KV budget, as blocks of its share of the heads; the cache must have the same
        blocks on every rank (rank 0's block manager hands out ids for all), so the smallest wins."""
        return _min_over_ranks(num_blocks, device)

    def start(self, runner: ModelRunner, num_blocks: int, num_cpu_blocks: int) -> None:
        """Tell the workers the KV cache's size (they allocate it and capture their graphs while rank 0
        does the same), and have `runner` send them every step from now on."""
        self.pipes.post(header(Msg.ALLOCATE, num_blocks, num_cpu_blocks))
        runner.step_sender = StepSender(self.pipes)

    def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on rank 0 while the workers do their part (start-up, a step). If it fails, the ranks
        are out of step and the group stops; a worker's death, the likely cause (gloo raises as it
        happens), is named."""
        self.check()
        try:
            return fn(*args)
        except Exception as e:
            dead = self._dead_worker(2.0)  # a moment for a dying worker's exit to be seen
            self.error = dead or f"the tensor-parallel group stopped after an error on rank 0 ({e!r})"
            self.shutdown()
            if dead:
                raise RuntimeError(f"{dead}; the engine has stopped.") from e
            raise

    def check(self) -> None:
        """Raise if a worker has exited or the group has stopped."""
        self.error = self.error or self._dead_worker()
        if self.error is not None:
            self.shutdown()
            raise RuntimeError(f"{self.error}; the engine has stopped.")

    def _dead_worker(self, timeout: float | None = 0.0) -> str | None:
        """Which worker has exited (waiting up to `timeout` seconds for one; None: for ever), if any."""
        ready = wait([p.sentinel for p in self.procs], timeout)
        for rank, proc in enumerate(self.procs, 1):
            if proc.sentinel in ready:
                with self._reaping:
                    proc.join()  # its sentinel can be ready a moment before its exit code is
                return f"tensor-parallel worker rank {rank} exited with code {proc.exitcode}"
        return None

    def _watch(self) -> None:
        """Wake when a worker exits; unless rank 0 asked it to, the engine is going down."""
        dead = self._dead_worker(None)
        if self._closing:
            return
        logger.error("%s; the engine is stopping", dead)
        if self.backend == "nccl":  # rank 0 may be waiting in a collective for the dead rank: unblock it
            dist.distributed_c10d._abort_process_group()

    def shutdown(self) -> None:
        """Stop the workers (asked first, killed if they do not leave) and leave the group. Idempotent;
        also run at exit."""
        if self._closing:
            return
        self._closing = True
        self.error = self.error or "the tensor-parallel workers were shut down"
        atexit.unregister(self.shutdown)
        try:
            self.pipes.post(header(Msg.SHUTDOWN))
        except OSError:  # a worker already gone
            pass
        self.pipes.close()
        with self._reaping:
            for proc in self.procs:
                proc.join(_JOIN_TIMEOUT_S)
                if proc.exitcode is None:
                    proc.kill()
                    proc.join()
        destroy_distributed()


def _check(size: int, model_cfg: TransformerConfig, device: torch.device) -> None:
    """Before spawning anything: what would make a rank fail."""
    model_cfg.heads_per_rank(size)
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(
                f"with tensor_parallel_size > 1, rank r runs on cuda:r: pass device='cuda', not {str(device)!r}."
            )
        if size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} GPUs, but {torch.cuda.device_count()} are visible."
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capture(fn, failure: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        failure.append(e)


def _exit_with_parent() -> None:
    """A worker inside an NCCL collective would wait for a dead rank 0 until the timeout."""
    wait([mp.parent_process().sentinel])
    os._exit(1)


def _min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _worker_main(
    rank: int, size: int, init_method: str, backend: str, config: EngineConfig, conn: Connection, threads: int
) -> None:
    """A worker process: join the group, build this rank's runner, offer its KV budget, serve steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if backend == "gloo":
        torch.set_num_threads(threads)
    init_distributed(rank, size, init_method, backend, COLLECTIVE_TIMEOUT)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    source = load_configured(config.model)
    runner = ModelRunner(config, source, TransformerConfig.from_hf(source.hf_config), device)
    _min_over_ranks(runner.num_blocks_for_budget(), device)
    serve_steps(runner, conn)
    destroy_distributed()


def serve_steps(runner: ModelRunner, conn: Connection) -> None:
    """A worker's loop: run what rank 0 sends until it says stop (or its pipe closes: rank 0 is gone)."""
    while True:
        try:
            msg = np.frombuffer(conn.recv_bytes(), dtype=np.int64)
        except EOFError:
            return
        kind, fields = Msg(msg[0]), msg[1:HEADER_LEN].tolist()
        if kind is Msg.SHUTDOWN:
            return
        if kind is Msg.ALLOCATE:
            runner.allocate_kv_cache(fields[0], fields[1])
            runner.warm_up()
        else:
            _run_step(runner, fields, msg[HEADER_LEN:])


@torch.inference_mode()
def _run_step(runner: ModelRunner, fields: list[int], rest: np.ndarray) -> None:
    num_tokens, num_seqs, graph, max_query_len, max_seq_len, num_logits, first, *num_moves = fields
    arrays = runner.buffers.arrays(num_tokens, num_seqs, num_logits)
    arrays.np.query_start_loc[:] = rest[: num_seqs + 1]
    arrays.np.seq_lens[:] = rest[num_seqs + 1 : 2 * num_seqs + 1]
    pairs = rest[2 * num_seqs + 1 :].reshape(-1, 2).tolist()
    ends = np.cumsum(num_moves).tolist()
    runner.move_blocks(pairs[: ends[0]], pairs[ends[0] : ends[1]], pairs[ends[1] :])
    dist.broadcast(arrays.shared, src=0)
    key = (num_tokens, num_seqs, graph) if graph else None
    meta = runner.attention_metadata(arrays, max_query_len, max_seq_len, cuda_graph=key is not None)
    runner.run_forward(arrays, key, meta, first if first >= 0 else arrays.dev.logits_indices)
