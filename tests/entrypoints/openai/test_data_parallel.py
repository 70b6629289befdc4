"""`heron serve --data-parallel-size 2` with local engine processes (the mp backend): data_parallel_checks.py."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.data_parallel_checks import DataParallelChecks, process_ids
from tests.entrypoints.openai.remote_server import RemoteServer


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--data-parallel-size", "2")
    yield srv
    srv.stop()


class TestLocalReplicas(DataParallelChecks):
    def replica_pids(self, server: RemoteServer) -> list[int]:
        return [p for p in process_ids("multiprocessing.spawn") if _parent(p) == server.proc.pid]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
