"""The engine's own process, behind `AsyncLLM`: it owns the LLMEngine and steps it whenever there is work,
so the server's event loop (HTTP, JSON, streaming) and the engine never share a GIL. The messages it reads
and writes are in messages.py."""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection

from heron.config import EngineConfig
from heron.engine.messages import (
    AbortRequest,
    Added,
    AddLoRA,
    AddRequest,
    EngineDead,
    Ready,
    RemoveLoRA,
    RequestDelta,
    ServingInfo,
    Shutdown,
    StepOutputs,
)
from heron.engine.output_processor import OutputProcessor
from heron.engine.request import Request
from heron.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


def run_engine_core(
    config: EngineConfig,
    commands: Connection,
    events: Connection,
    cpu_threads: int | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """The engine process's main: load, announce, then serve the pipes until told to stop or the API
    process goes away (end of file). `cpu_threads`: torch's thread count here (None: torch's default);
    `env`: variables to set before the model loads (a data-parallel replica's CUDA_VISIBLE_DEVICES)."""
    os.environ.update(env or {})
    import torch

    from heron.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    # Ctrl-C reaches the whole process group: the API process decides when the engine stops (it drains
    # requests first), and tells it with Shutdown or by closing the pipe.
    if threading.current_thread() is threading.main_thread():  # (a Ray actor may run this on another thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = None
    try:
        engine = LLMEngine(config)
        info = ServingInfo(
            engine.model_name,
            engine.max_model_len,
            engine.tokenizer,
            engine.generation_defaults,
            engine.model_cfg.vocab_size,
            engine.config.scheduler.max_num_seqs,
            config.model.runner,
            engine.get_stats().num_gpu_blocks,
            engine.max_logprobs,
        )
        events.send(Ready(info))
        _serve(engine, commands, events)
    except (EOFError, BrokenPipeError):
        return
    except BaseException as e:  # noqa: BLE001 - the API process must hear why, then this process exits
        logger.error("engine failed:\n%s", traceback.format_exc())
        try:
            events.send(EngineDead(f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass
    finally:
        if engine is not None:
            engine.shutdown()


def _serve(engine, commands: Connection, events: Connection) -> None:
    while True:
        # Wait for a message when idle; with work, only take what has arrived.
        while commands.poll(None if not engine.has_unfinished() else 0):
            msg = commands.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequest):
                engine.abort(msg.request_id)
                if not engine.has_unfinished():  # the stats the API process shows must see the freed blocks
                    events.send(StepOutputs([], engine.get_stats()))
                continue
            if isinstance(msg, RemoveLoRA):
                engine.remove_lora(msg.lora_int_id)
                continue
            events.send(
                Added(msg.request_id, _add_lora(engine, msg) if isinstance(msg, AddLoRA) else _add(engine, msg))
            )
        if engine.has_unfinished():
            out = engine.output_processor
            events.send(StepOutputs([request_delta(r, out) for r in engine.advance()], engine.get_stats()))


def _add(engine, msg: AddRequest) -> tuple[str, str] | None:
    """Queue the request; its rejection, for the caller, if any. Requests run with RequestOutputKind.DELTA,
    so that a step's message carries only its new tokens and text."""
    try:
        msg.params.verify_vocab(engine.model_cfg.vocab_size)
        engine.add_request(
            msg.request_id,
            msg.prompt,
            replace(msg.params, output_kind=RequestOutputKind.DELTA),
            priority=msg.priority,
            add_special_tokens=msg.add_special_tokens,
            prompt_token_ids=msg.prompt_token_ids,
            lora_request=msg.lora_request,
            pooling_params=msg.pooling_params,
        )
    except Exception as e:  # noqa: BLE001 - the caller gets it as the answer to its request
        return type(e).__name__, str(e)
    return None


def _add_lora(engine, msg: AddLoRA) -> tuple[str, str] | None:
    try:
        engine.add_lora(msg.lora_request)
    except Exception as e:  # noqa: BLE001 - the caller gets it: a bad adapter (ValueError), or no enable_lora
        return type(e).__name__, str(e)
    return None


def request_delta(request: Request, outputs: OutputProcessor) -> RequestDelta:
    """The request's news since its previous delta."""
    m = request.metrics
    first = not request.sent_prompt
    request.sent_prompt = True
    return RequestDelta(
        (
            request.request_id,
            request.is_finished,
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time),
            [outputs.news(s) for s in request.seqs],  # CompletionDelta's items, in order
            first,
            request.prompt_logprobs if first else None,
            request.seqs[0].num_cached_tokens if first else 0,
            request.embedding,
        )
    )
