"""Data parallelism offline: `DataParallelLLMEngine` is the part of LLMEngine that `LLM` and `heron run-batch`
drive (add_request, step, abort, has_unfinished, and the model's facts), over the server's replicas
(`DataParallelAsyncLLM`, router and all), whose event loop runs on a thread of its own. So LLM's loops, and its
outputs in input order, are the same whatever the number of replicas; each finished request comes back from
`step` as soon as its replica has finished it."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from dataclasses import dataclass

from heron.config import EngineConfig, resolve_device
from heron.engine.async_llm import RequestStream
from heron.engine.data_parallel import DataParallelAsyncLLM
from heron.lora_request import LoRARequest
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams


@dataclass
class ModelFacts:
    """What LLM and run-batch read of LLMEngine.model_cfg."""

    vocab_size: int


class DataParallelLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._client = DataParallelAsyncLLM(config, _cpu_threads(config))
        info = self._client.info
        self.model_name, self.max_model_len, self.tokenizer = info.model_name, info.max_model_len, info.tokenizer
        self.generation_defaults = info.generation_defaults
        self.model_cfg = ModelFacts(info.vocab_size)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="heron-dp-offline", daemon=True)
        self._thread.start()
        self._running: dict[str, asyncio.Future] = {}  # request id -> the task reading its stream
        self._done: queue.SimpleQueue[tuple[str, RequestOutput | BaseException]] = queue.SimpleQueue()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue the request on the replica the router picks; its rejection raises ValueError here, as
        LLMEngine's does."""
        del arrival_time  # (the replica stamps its own)
        params = params or SamplingParams(**self.generation_defaults)
        add = self._client.add_request(
            prompt, params, request_id, priority, add_special_tokens, lora_request, prompt_token_ids=prompt_token_ids
        )
        stream = asyncio.run_coroutine_threadsafe(add, self._loop).result()
        self._running[request_id] = asyncio.run_coroutine_threadsafe(self._read(request_id, stream), self._loop)

    async def _read(self, request_id: str, stream: RequestStream) -> None:
        try:
            async for out in stream:
                if out.finished:
                    self._done.put((request_id, out))
        except Exception as e:  # noqa: BLE001 - a replica's death: step raises it in the caller's thread
            self._done.put((request_id, e))
        finally:
            stream.close()

    def step(self) -> list[RequestOutput]:
        """The requests finished since the last call; waits for one when none has."""
        if not self._running:
            return []
        finished = [self._done.get()]
        while not self._done.empty():
            finished.append(self._done.get())
        outputs = []
        for request_id, out in finished:
            self._running.pop(request_id, None)
            if isinstance(out, BaseException):
                raise out
            outputs.append(out)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def abort(self, request_id: str) -> None:
        """Closing the request's stream aborts it on its replica."""
        if (reader := self._running.pop(request_id, None)) is not None:
            reader.cancel()

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError("reset_prefix_cache is not supported with data_parallel_size > 1.")

    def shutdown(self) -> None:
        self._client.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


def _cpu_threads(config: EngineConfig) -> int | None:
    """On the CPU, the cores shared out between the replicas (torch's default, a thread per core in each,
    makes them fight for every core); None on a GPU."""
    if resolve_device(config.device).type != "cpu":
        return None
    return max(1, len(os.sched_getaffinity(0)) // config.parallel.data_parallel_size)
