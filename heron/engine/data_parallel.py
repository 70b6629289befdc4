"""Data parallelism for the server: `DataParallelAsyncLLM` is AsyncLLM's interface over N engine replicas
(config.parallel.data_parallel_size), each an AsyncLLM of its own (a local process or a Ray actor:
replica_launch.py), with router.py's cache-aware policy choosing the replica of each request.

The front end tokenizes a text prompt once, hashes its full blocks as the engines' prefix cache does, and
asks the router: the replica that holds the longest prefix of the prompt, unless it has `slack` requests more
than the least loaded one (or a full KV cache); else the user's last replica (sticky sessions); else the least
loaded. The caller then holds that replica's own RequestStream, so streaming and aborts (a closed stream, a
client's disconnect) go to the replica with no hop through this class; the router's counts are read from the
replicas' open streams at each choice, so nothing has to tell it when a request ends.

A replica that dies is taken out of rotation: its requests in flight fail with `ReplicaDeadError` (a 503
saying the other replicas still serve), a request that it had not yet accepted goes to another replica, and
`health()` says which are alive. When the last one dies, the whole is dead as one AsyncLLM would be.

With data_parallel_size 1 none of this exists: the server runs AsyncLLM itself."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

from heron.config import EngineConfig
from heron.engine.async_llm import AsyncLLM, EngineDeadError, EngineLaunch, RequestStream
from heron.engine.replica_launch import replica_launchers
from heron.engine.router import CacheAware, block_hashes
from heron.lora_request import LoRARequest
from heron.outputs import EmbeddingRequestOutput, RequestOutput
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams
from heron.stats import EngineStats

logger = logging.getLogger(__name__)


class ReplicaDeadError(EngineDeadError):
    """One replica died; the others still serve."""


class _Replica(AsyncLLM):
    def __init__(
        self, index: int, config: EngineConfig, cpu_threads: int | None, launch: Callable[[], EngineLaunch]
    ) -> None:
        self.index = index
        super().__init__(config, cpu_threads, launch)

    def _dead_error(self, error: BaseException) -> EngineDeadError:
        return ReplicaDeadError(f"engine replica {self.index} has stopped ({error!r}); the other replicas still serve")


class DataParallelAsyncLLM:
    def __init__(self, config: EngineConfig, cpu_threads: int | None = None) -> None:
        """Start the replicas at once and wait until all have loaded; if one fails, stop the others and raise."""
        n = config.parallel.data_parallel_size
        launchers = replica_launchers(config, cpu_threads)
        with ThreadPoolExecutor(n, thread_name_prefix="heron-replica-start") as pool:
            starting = [pool.submit(_Replica, i, config, cpu_threads, launch) for i, launch in enumerate(launchers)]
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            for f in starting:
                if f.exception() is None:
                    f.result().shutdown()
            raise failed[0]
        self.replicas: list[_Replica] = [f.result() for f in starting]
        first = self.replicas[0]
        self.info = first.info
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.tokenizer, self.generation_defaults = first.tokenizer, first.generation_defaults
        self.block_size = config.cache.block_size
        self.router = CacheAware(n, cache_blocks=max(1, first.info.num_gpu_blocks))
        self.dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()  # replicas die on their reader threads
        for r in self.replicas:
            r.on_dead(lambda error, r=r: self._replica_died(r.index, error))
        logger.info("%d engine replicas ready (%s backend)", n, config.parallel.data_parallel_backend)

    @classmethod
    def from_config(cls, config: EngineConfig, cpu_threads: int | None = None) -> DataParallelAsyncLLM:
        return cls(config, cpu_threads)

    def health(self) -> list[bool]:
        """Which replicas are alive, by index."""
        return list(self.router.alive)

    def get_stats(self) -> EngineStats:
        """The replicas' stats summed (KV usage over all their blocks)."""
        return sum_stats([stats for stats, _ in self.replica_stats()])

    def replica_stats(self) -> list[tuple[EngineStats, bool]]:
        """Each replica's latest stats and whether it is alive. A dead one keeps its counters, but holds no
        request and no cache any more."""
        return [
            (
                r.get_stats()
                if alive
                else replace(r.get_stats(), num_running=0, num_waiting=0, kv_cache_usage=0.0, num_gpu_blocks=0),
                alive,
            )
            for r, alive in zip(self.replicas, self.router.alive)
        ]

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` when the last replica has died."""
        self._death_callbacks.append(callback)
        if self.dead is not None:
            callback(self.dead)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        user: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """AsyncLLM.add_request on the replica the router picks; a replica found dead before it accepted the
        request hands it to the next pick."""
        ids = prompt if not isinstance(prompt, str) else prompt_token_ids
        if ids is None:
            ids = await self.tokenize(prompt, add_special_tokens)
        hashes = block_hashes(ids, self.block_size) if ids is not None else []
        while True:
            if self.dead is not None or not any(self.router.alive):
                raise EngineDeadError(f"every engine replica has stopped: {self.dead!r}")
            for i, r in enumerate(self.replicas):  # the router's load: what each replica holds now
                self.router.outstanding[i] = r.num_in_flight
                self.router.kv_usage[i] = r.get_stats().kv_cache_usage
            replica = self.replicas[self.router.choose(hashes, user)]
            try:
                text_ids = ids if isinstance(prompt, str) else None  # (made here, not to be made again)
                return await replica.add_request(
                    prompt,
                    params,
                    request_id,
                    priority,
                    add_special_tokens,
                    lora_request,
                    pooling_params,
                    prompt_token_ids=text_ids,
                )
            except ReplicaDeadError:  # it died before accepting the request: the request never ran there
                self.router.remove(replica.index)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        user: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate through the router."""
        stream = await self.add_request(
            prompt, params, request_id, priority, add_special_tokens, lora_request, user=user
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def encode(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> EmbeddingRequestOutput:
        """AsyncLLM.encode on the replica the router picks for the prompt."""
        ids = await self.tokenize(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
        replica = self.replicas[self.router.choose(block_hashes(ids, self.block_size) if ids else [], None)]
        return await replica.encode(prompt if ids is None else ids, params, request_id, priority, add_special_tokens)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Every live replica reads and checks the adapter (any of them may be routed its requests)."""
        live = [r for r, alive in zip(self.replicas, self.router.alive) if alive]
        await asyncio.gather(*(r.add_lora(lora_request) for r in live))

    def remove_lora(self, lora_int_id: int) -> None:
        for r, alive in zip(self.replicas, self.router.alive):
            if alive:
                r.remove_lora(lora_int_id)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        return await self.replicas[0].tokenize(text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.replicas[0].detokenize(token_ids)

    def abort_all(self, message: str) -> None:
        for r in self.replicas:
            r.abort_all(message)

    def shutdown(self) -> None:
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.shutdown(), self.replicas))

    def _replica_died(self, index: int, error: BaseException) -> None:
        """On the dead replica's reader thread: out of rotation; when none is left, dead as a whole."""
        with self._lock:
            self.router.remove(index)
            logger.error(
                "Engine replica %d has stopped (%s): %d of %d still serve",
                index,
                error,
                sum(self.router.alive),
                len(self.replicas),
            )
            if any(self.router.alive) or self.dead is not None:
                return
            self.dead = error
        for callback in self._death_callbacks:
            callback(error)


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counters and gauges added up; KV usage as the fraction of all the replicas' blocks in use."""
    total = EngineStats()
    for s in stats:
        for f in fields(EngineStats):
            if f.name not in ("kv_cache_usage", "finished"):
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        for reason, count in dict(s.finished).items():
            total.finished[reason] = total.finished.get(reason, 0) + count
    blocks = total.num_gpu_blocks
    total.kv_cache_usage = sum(s.kv_cache_usage * s.num_gpu_blocks for s in stats) / blocks if blocks else 0.0
    return total
