"""How rank 0 hands each step to the other tensor-parallel ranks, and how they run it.

Rank 0 schedules and prepares the step in its runner's input buffers as it would alone, then sends
  1. over each worker's pipe, one int64 array: a fixed header (the message kind and the step's sizes),
     the host copies of query_start_loc and seq_lens (attention backends plan from them) and the block
     moves. Raw bytes, nothing pickled; and a worker waits for it in a blocking read, which no
     collective timeout cuts short however long the engine idles;
  2. the filled prefixes of the device input arrays and the logits row indices, broadcast from rank 0
     over the process group (device to device with NCCL).
Every rank then runs the same forward pass (or replays the same captured graph); the LM head gathers
the vocabulary, and only rank 0 samples. The same pipe carries the two other messages: allocate the
KV cache (rank 0 decides its size for all) and shut down.
"""

from __future__ import annotations

import enum
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from heron.engine.scheduler import ScheduledBatch
from heron.executor.attention import AttentionMetadata
from heron.executor.input_buffers import InputBuffers

if TYPE_CHECKING:
    from heron.executor.model_runner import ModelRunner

HEADER_LEN = 10  # kind, then the fields of the kind (zeros where unused)


class Msg(enum.IntEnum):
    STEP = 0  # num_tokens, num_seqs, graph_size (0: eager), max_query_len, max_seq_len, logits rows,
    #           swap-outs, swap-ins, block copies
    ALLOCATE = 1  # num_blocks, num_cpu_blocks: allocate the KV cache, then capture the CUDA graphs
    SHUTDOWN = 2


def header(kind: Msg, *fields: int) -> np.ndarray:
    head = np.zeros(HEADER_LEN, dtype=np.int64)
    head[: 1 + len(fields)] = (kind, *fields)
    return head


class Pipes:
    """Rank 0's write ends of the workers' pipes. Locked: the engine thread sends steps, while a
    shutdown may come from another thread."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns
        self._lock = threading.Lock()

    def post(self, msg: np.ndarray) -> None:
        with self._lock:
            for conn in self.conns:
                conn.send_bytes(msg)

    def close(self) -> None:
        with self._lock:
            for conn in self.conns:
                conn.close()


class StepSender:
    """Rank 0's side: called by the runner between preparing a step and running it."""

    def __init__(self, buffers: InputBuffers, pipes: Pipes) -> None:
        self.buffers = buffers
        self.pipes = pipes

    def send(self, batch: ScheduledBatch, num_tokens: int, graph_size: int | None, meta: AttentionMetadata,
             logits_indices: torch.Tensor) -> None:
        b = self.buffers
        if graph_size:  # the padded rows go too: the graph reads all of them
            num_tokens, num_seqs, max_query_len, max_seq_len = graph_size, graph_size, 1, 1
        else:
            num_seqs, max_query_len, max_seq_len = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        moves = (batch.swap_out, batch.swap_in, batch.block_copies)
        head = header(Msg.STEP, num_tokens, num_seqs, graph_size or 0, max_query_len, max_seq_len,
                      len(logits_indices), *map(len, moves))
        pairs = np.asarray([p for m in moves for p in m], dtype=np.int64).reshape(-1)
        self.pipes.post(np.concatenate([head, b.np.query_start_loc[: num_seqs + 1], b.np.seq_lens[:num_seqs], pairs]))
        for t in (*b.device_prefixes(num_tokens, num_seqs), logits_indices):
            _broadcast(t)


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
    num_tokens, num_seqs, graph_size, max_query_len, max_seq_len, num_logits, *num_moves = fields
    b = runner.buffers
    b.np.query_start_loc[: num_seqs + 1] = rest[: num_seqs + 1]
    b.np.seq_lens[:num_seqs] = rest[num_seqs + 1: 2 * num_seqs + 1]
    pairs = rest[2 * num_seqs + 1:].reshape(-1, 2).tolist()
    ends = np.cumsum(num_moves).tolist()
    runner._move_blocks(ScheduledBatch(swap_out=pairs[: ends[0]], swap_in=pairs[ends[0]: ends[1]],
                                       block_copies=pairs[ends[1]:]))
    for t in b.device_prefixes(num_tokens, num_seqs):
        _broadcast(t)
    logits_indices = torch.empty(num_logits, dtype=torch.long, device=runner.device)
    _broadcast(logits_indices)
    meta = runner._metadata(num_seqs, num_tokens, max_query_len, max_seq_len, cuda_graph=graph_size > 0)
    runner.run_forward(num_tokens, graph_size or None, meta, logits_indices)


def _broadcast(t: torch.Tensor) -> None:
    if t.numel():  # both sides know the sizes from the header, so an empty one is simply not sent
        dist.broadcast(t, src=0)
