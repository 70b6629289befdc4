"""How rank 0 hands each step to the other tensor-parallel ranks (tp_worker.py runs it there).

Rank 0 schedules and prepares the step in its runner's input buffers as it would alone, then sends
  1. over each worker's pipe, one int64 array: a fixed header (the message kind and the step's sizes),
     the host copies of query_start_loc and seq_lens (attention backends plan from them) and the block
     moves. Raw bytes, nothing pickled; and a worker waits for it in a blocking read, which no
     collective timeout cuts short however long the engine idles;
  2. the step's device inputs through the logits row indices, one packed region (see input_buffers.py),
     in one broadcast from rank 0 over the process group (device to device with NCCL).
Every rank then runs the same forward pass (or replays the same captured graph); the LM head gathers
the vocabulary, and only rank 0 samples. The same pipe carries the two other messages: allocate the
KV cache (rank 0 decides its size for all) and shut down.
"""

from __future__ import annotations

import enum
import threading
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from heron.attention import AttentionMetadata
from heron.batch import ScheduledBatch
from heron.executor.graph_keys import GraphKey
from heron.executor.input_buffers import StepArrays

HEADER_LEN = 11  # kind, then the fields of the kind (zeros where unused)


class Msg(enum.IntEnum):
    STEP = 0  # num_tokens, num_seqs, graph (Q: replay the graph keyed by those two counts and Q, 0: eager),
    #           max_query_len, max_seq_len, logits indices, first logits rows (-1: the indices instead),
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

    def __init__(self, pipes: Pipes) -> None:
        self.pipes = pipes

    def send(
        self,
        batch: ScheduledBatch,
        arrays: StepArrays,
        graph: GraphKey | None,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | int,
    ) -> None:
        """The header and host lengths over the pipes, then the step's device inputs in one broadcast (the
        padded rows of a graph's batch too: the graph reads all of them). `graph`: the captured graph that
        runs the step (its first two counts are the arrays' padded ones, which the header carries anyway)."""
        first = logits_rows if isinstance(logits_rows, int) else -1
        moves = (batch.swap_out, batch.swap_in, batch.block_copies)
        head = header(
            Msg.STEP,
            arrays.num_tokens,
            arrays.num_seqs,
            graph[2] if graph else 0,
            meta.max_query_len,
            meta.max_seq_len,
            len(arrays.dev.logits_indices),
            first,
            *map(len, moves),
        )
        pairs = np.asarray([p for m in moves for p in m], dtype=np.int64).reshape(-1)
        self.pipes.post(np.concatenate([head, arrays.np.query_start_loc, arrays.np.seq_lens, pairs]))
        dist.broadcast(arrays.shared, src=0)
