"""The step header rank 0 sends tensor-parallel workers, read back by a worker's loop: the same counts,
lengths, block moves, logits rows and graph (a worker must replay the graph rank 0 replays). The broadcast
of the device inputs is left out (tests/executor/test_tensor_parallel_engine.py runs it over gloo)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from heron.attention import AttentionMetadata
from heron.batch import ScheduledBatch
from heron.executor import step_broadcast
from heron.executor.input_buffers import InputBuffers
from heron.executor.step_broadcast import Pipes, StepSender
from heron.executor.tp_worker import serve_steps


class _Conn:
    """Both ends of one pipe, in memory: what rank 0 posts, a worker receives in order."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data) -> None:
        self.sent.append(bytes(data))

    def recv_bytes(self) -> bytes:
        if not self.sent:
            raise EOFError
        return self.sent.pop(0)


class _Worker:
    """A worker's runner (the public methods a worker calls), recording what the step asks of it."""

    def __init__(self) -> None:
        self.buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
        self.calls: list[tuple] = []

    def move_blocks(self, swap_out, swap_in, copies) -> None:
        self.calls.append(("moves", swap_out, swap_in, copies))

    def attention_metadata(self, arrays, max_query_len: int, max_seq_len: int, cuda_graph: bool) -> SimpleNamespace:
        return SimpleNamespace(
            lens=(max_query_len, max_seq_len),
            cuda_graph=cuda_graph,
            qsl=arrays.np.query_start_loc.tolist(),
            seq_lens=arrays.np.seq_lens.tolist(),
        )

    def run_forward(self, arrays, graph, meta, logits_rows) -> None:
        rows = logits_rows if isinstance(logits_rows, int) else len(logits_rows)
        self.calls.append(("forward", (arrays.num_tokens, arrays.num_seqs), graph, vars(meta), rows))


@pytest.mark.parametrize("graph,first_rows", [(True, False), (False, False), (True, True)])
def test_a_step_reaches_the_worker_with_its_graph(monkeypatch, graph, first_rows):
    monkeypatch.setattr(step_broadcast.dist, "broadcast", lambda tensor, src: None)
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    num_tokens, num_seqs = (16, 8) if graph else (9, 3)
    arrays = buffers.arrays(num_tokens, num_seqs, num_logits=3)
    qsl = np.array([0, 1, 7, 9, 9, 9, 9, 9, 9][: num_seqs + 1])  # 3 sequences, 5 more padded in a graph
    arrays.np.query_start_loc[:] = qsl
    arrays.np.seq_lens[:] = np.diff(qsl) + 4
    meta = AttentionMetadata(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        query_start_loc=arrays.dev.query_start_loc,
        seq_lens=arrays.dev.seq_lens,
        block_tables=arrays.dev.block_tables,
        slot_mapping=arrays.dev.slot_mapping,
        max_query_len=6,
        max_seq_len=10,
        query_start_loc_cpu=arrays.host.query_start_loc,
        seq_lens_cpu=arrays.host.seq_lens,
    )
    batch = ScheduledBatch(swap_out=[(1, 2)], swap_in=[], block_copies=[(3, 4), (5, 6)])
    conn = _Conn()
    key = (num_tokens, num_seqs, 16) if graph else None
    StepSender(Pipes([conn])).send(batch, arrays, key, meta, 2 if first_rows else arrays.dev.logits_indices)

    worker = _Worker()
    serve_steps(worker, conn)  # one step, then the pipe is empty: EOF ends the loop
    assert worker.calls == [
        ("moves", [[1, 2]], [], [[3, 4], [5, 6]]),
        (
            "forward",
            (num_tokens, num_seqs),
            key,
            dict(lens=(6, 10), cuda_graph=graph, qsl=qsl.tolist(), seq_lens=(np.diff(qsl) + 4).tolist()),
            2 if first_rows else 3,
        ),
    ]
