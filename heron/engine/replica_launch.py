"""Where data-parallel replicas run: `mp`, one local engine process each (the GPUs of the host dealt out in
groups of tensor_parallel_size through CUDA_VISIBLE_DEVICES); `ray`, one Ray actor each (Ray picks the node and
the GPUs: `num_gpus=tensor_parallel_size`; CPU-only actors when the engine runs on the CPU), spread over the
cluster's nodes.

Either way the engine is `engine_core.run_engine_core` behind the same two connections AsyncLLM reads: pipes
for a local process; for an actor, two TCP connections from the front end to a listener the actor opened
(multiprocessing.connection with a random key). Each step's outputs then stream to the front end as they do
from a local process, instead of one Ray call per step; Ray places, starts and stops the engines, and tells
when one has died."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from multiprocessing.connection import Client, Listener

from heron.config import EngineConfig, resolve_device
from heron.engine.async_llm import EngineLaunch, spawn_engine_process
from heron.engine.engine_core import run_engine_core


def replica_launchers(config: EngineConfig, cpu_threads: int | None) -> list[Callable[[], EngineLaunch]]:
    """One launcher per replica of config.parallel, for the backend it names."""
    if config.parallel.data_parallel_backend == "ray":
        return _ray_launchers(config, cpu_threads)
    return [functools.partial(spawn_engine_process, config, cpu_threads, env) for env in _local_gpu_envs(config)]


def _local_gpu_envs(config: EngineConfig) -> list[dict[str, str] | None]:
    """Each local replica's CUDA_VISIBLE_DEVICES: the visible GPUs in consecutive groups of
    tensor_parallel_size; nothing on the CPU."""
    p = config.parallel
    if resolve_device(config.device).type != "cuda":
        return [None] * p.data_parallel_size
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    need = p.data_parallel_size * p.tensor_parallel_size
    if need > len(gpus):
        raise ValueError(
            f"data_parallel_size {p.data_parallel_size} x tensor_parallel_size {p.tensor_parallel_size} needs "
            f"{need} GPUs, but {len(gpus)} are visible (use --data-parallel-backend ray for several hosts)."
        )
    tp = p.tensor_parallel_size
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(p.data_parallel_size)]


# -- Ray -----------------------------------------------------------------------------------------------------


class EngineActor:
    """A replica's engine in a Ray actor: it listens on a free port of its node, then serves the front end's
    two connections (commands, then events) with the engine until told to stop or the front end goes away."""

    def __init__(self, authkey: bytes) -> None:
        self._listener = Listener(("0.0.0.0", 0), authkey=authkey)

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), self._listener.address[1]

    def serve(self, config: EngineConfig, cpu_threads: int | None) -> None:
        commands = self._listener.accept()
        events = self._listener.accept()
        self._listener.close()
        run_engine_core(config, commands, events, cpu_threads)


class _ActorProcess:
    """A Ray actor as AsyncLLM watches an engine process (async_llm.EngineProcess)."""

    def __init__(self, actor, serving) -> None:
        self._actor = actor
        self._serving = serving  # the ObjectRef of EngineActor.serve: ready when the engine has stopped
        self.exitcode: str | None = None

    def join(self, timeout: float | None = None) -> None:
        import ray

        done, _ = ray.wait([self._serving], timeout=timeout)
        if done and self.exitcode is None:
            try:
                ray.get(done[0])
                self.exitcode = "the Ray actor returned"
            except Exception as e:  # noqa: BLE001 - the actor's death is the answer
                self.exitcode = f"the Ray actor failed: {type(e).__name__}"

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def terminate(self) -> None:
        import ray

        ray.kill(self._actor)


def init_ray(config: EngineConfig) -> None:
    """Join the cluster of config.parallel.ray_address, as ray.init takes it (None: RAY_ADDRESS if set, else
    the cluster this node runs, else a new Ray of this machine), unless this process already has. A server
    calls it on its main thread before it takes SIGTERM: Ray's own handler, installed later, would abort the
    process instead of letting it drain."""
    try:
        import ray
    except ImportError:
        raise ValueError("data_parallel_backend ray needs Ray: pip install 'heron[ray]'.") from None
    if not ray.is_initialized():
        ray.init(address=config.parallel.ray_address, include_dashboard=False)


def _ray_launchers(config: EngineConfig, cpu_threads: int | None) -> list[Callable[[], EngineLaunch]]:
    init_ray(config)
    import ray

    on_gpu = config.device.startswith("cuda") or (config.device == "auto" and ray.cluster_resources().get("GPU", 0))
    resources = (
        dict(num_gpus=config.parallel.tensor_parallel_size, num_cpus=1) if on_gpu else dict(num_gpus=0, num_cpus=1)
    )
    # The replicas' files: PYTHONPATH as here, so that an actor imports the Heron this process runs.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    actor_class = ray.remote(EngineActor).options(
        scheduling_strategy="SPREAD", runtime_env={"env_vars": env}, **resources
    )

    def launch() -> EngineLaunch:
        authkey = os.urandom(32)
        actor = actor_class.remote(authkey)
        host, port = ray.get(actor.address.remote())
        serving = actor.serve.remote(config, cpu_threads)
        commands = Client((host, port), authkey=authkey)
        events = Client((host, port), authkey=authkey)
        return _ActorProcess(actor, serving), commands, events

    return [launch] * config.parallel.data_parallel_size
