"""What a `heron serve --data-parallel-size 2` server must do whatever its backend (test_data_parallel.py: local
processes; test_data_parallel_ray.py: Ray actors). Each module starts one server and runs these in order; the
last one kills a replica. Which replica served what is read from the per-replica metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import httpx

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer, parallel

# Two system prompts of several KV blocks (16 tokens each) that differ from their first words.
SYSTEM_A = "You are Ada, a terse assistant for astronomy questions. " * 6
SYSTEM_B = "Bob here: a cheerful helper who answers cooking questions at length. " * 6


def replica_tokens(server: RemoteServer) -> list[float]:
    m = server.metrics()
    return [m[f"heron:replica_prompt_tokens_total{{replica={i}}}"] for i in range(2)]


def chat(server: RemoteServer, system: str, question: str, max_tokens: int = 4, **kw):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def process_ids(pattern: str) -> list[int]:
    """The processes whose command line holds `pattern` (the replicas this test's server started)."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


class DataParallelChecks:
    """Subclassed by each backend's module, which provides the `server` fixture and `replica_pids`."""

    def replica_pids(self, server: RemoteServer) -> list[int]:
        raise NotImplementedError

    def test_health_and_models_as_one_engine(self, server):
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200
        assert health.json() == {
            "status": "ok",
            "replicas": [{"replica": 0, "alive": True}, {"replica": 1, "alive": True}],
        }
        assert [m.id for m in server.client().models.list().data] == [MODEL]
        m = server.metrics()
        assert m["heron:replica_up{replica=0}"] == m["heron:replica_up{replica=1}"] == 1

    def test_requests_spread_and_replicas_agree(self, server):
        # Prompts shorter than a block match no cache: concurrent ones go to the least loaded, one each.
        before = replica_tokens(server)
        outs = parallel(
            *[
                lambda: server.client().completions.create(
                    model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
                )
            ]
            * 2
        )
        after = replica_tokens(server)
        assert all(a > b for a, b in zip(after, before)), (before, after)
        assert outs[0].choices[0].text == outs[1].choices[0].text
        m = server.metrics()  # the unlabelled families are the sums
        assert m["heron:prompt_tokens_total"] == sum(after)

    def test_same_system_prompt_same_replica(self, server):
        # A long stream keeps one replica busy, so that B's first request goes to the other; then B's
        # requests, one at a time on an idle server, follow its blocks there, though the least loaded (tied:
        # the lowest index) would be the first replica each time. The user's key keeps them there too.
        aborted = server.metrics().get("heron:request_success_total{finished_reason=abort}", 0)
        with server.client().chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Name a star."}],
            max_tokens=500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            wait_for(lambda: server.metrics()["heron:num_requests_running"] == 1)
            before = replica_tokens(server)
            chat(server, SYSTEM_B, "How long do I boil an egg?")
            after = replica_tokens(server)
            home = next(i for i in range(2) if after[i] > before[i])
        # The client hung up mid-stream: its replica aborts the request.
        wait_for(lambda: server.metrics()["heron:request_success_total{finished_reason=abort}"] == aborted + 1)
        assert server.metrics()["heron:num_requests_running"] == 0
        other = 1 - home
        before = replica_tokens(server)
        for question in ("How do I dice an onion?", "What is a roux?"):
            chat(server, SYSTEM_B, question, user="b-session")
        chat(server, "Unrelated and short.", "Hi", user="b-session")  # sticky: the user's last replica
        after = replica_tokens(server)
        assert after[home] > before[home] and after[other] == before[other], (home, before, after)

    def test_replica_killed_mid_run(self, server):
        """Four long requests over both replicas; one replica is killed: its requests fail with a 503 in
        OpenAI's format naming it, the others finish, /health says degraded, and new requests are served."""

        def long_request():
            return httpx.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True},
                timeout=120,
            )

        pids = self.replica_pids(server)
        assert len(pids) == 2, pids
        running = lambda: server.metrics()["heron:num_requests_running"] == 4  # noqa: E731
        killer = lambda: (wait_for(running), os.kill(pids[0], signal.SIGKILL))  # noqa: E731
        *answers, _ = parallel(*[long_request] * 4, killer)
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 200, 503, 503], [a.text for a in answers]
        error = next(a for a in answers if a.status_code == 503).json()["error"]
        assert error["code"] == "replica_dead" and "replica" in error["message"], error
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        dead = [r["replica"] for r in health.json()["replicas"] if not r["alive"]]
        assert len(dead) == 1
        assert server.metrics()[f"heron:replica_up{{replica={dead[0]}}}"] == 0
        for _ in range(2):  # the survivor takes everything, the dead replica's session included
            assert chat(server, SYSTEM_B, "And a soufflé?", user="b-session").choices[0].message.content
