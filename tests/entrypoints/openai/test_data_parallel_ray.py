"""`heron serve --data-parallel-size 2 --data-parallel-backend ray`: the server starts a Ray of its own
(`--ray-address local`: never one this machine may already run) and places each replica in an actor:
data_parallel_checks.py."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.data_parallel_checks import DataParallelChecks, process_ids
from tests.entrypoints.openai.remote_server import RemoteServer

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address", "local")
    yield srv
    srv.stop()


class TestRayReplicas(DataParallelChecks):
    def replica_pids(self, server: RemoteServer) -> list[int]:
        return process_ids("ray::EngineActor")
