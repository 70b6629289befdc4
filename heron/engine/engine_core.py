"""The engine's own process, behind `AsyncLLM`: it owns the LLMEngine and steps it whenever there is work,
so the server's event loop (HTTP, JSON, streaming) and the engine never share a GIL.

Two pipes join the two processes, one each way; every message is a pickled tuple of plain values:
  to the engine    ("add", request_id, prompt, prompt_token_ids, params, priority, add_special_tokens)
                   (the API process tokenizes a text prompt; prompt_token_ids is None only when it has
                   no tokenizer, and the engine then rejects a text prompt)
                   ("abort", request_id)  ("shutdown",)
  from the engine  ("ready", ServingInfo)  once the model is loaded
                   ("added", request_id, None | (exception type name, message))
                   ("outputs", [wire outputs], EngineStats)  once a step (and after an abort that
                                                             leaves the engine idle)
                   ("dead", message)  the engine failed; the process exits after it
Requests run with RequestOutputKind.DELTA, so a step's message carries only its new tokens and text. A wire
output is made straight from the engine's request (`to_wire`), never a RequestOutput: tuples cost less to
build and several times less to pickle than the dataclasses. Per request that advanced in the step:
  (request_id, finished, (arrival_time, first_scheduled_time, first_token_time, last_token_time,
   finished_time), [(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason)],
   None | (prompt_logprobs, num_cached_tokens))
with one completion tuple per sequence (only its new text, token ids and logprobs) and the last item set in
the request's first output only. The prompt and its ids are never sent back: the API process made them.
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from heron.config import EngineConfig
from heron.engine.output_processor import OutputProcessor
from heron.engine.request import Request
from heron.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heron.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class ServingInfo:
    """What the API process needs to know of the engine."""

    model_name: str
    max_model_len: int
    tokenizer: object  # a transformers tokenizer (picklable), or None
    generation_defaults: dict
    vocab_size: int  # the model's (token ids and logit_bias keys must be below it)
    max_num_seqs: int  # a request's n samples must fit in one batch


def run_engine_core(
    config: EngineConfig, commands: Connection, events: Connection, cpu_threads: int | None = None
) -> None:
    """The engine process's main: load, announce, then serve the pipes until told to stop or the API
    process goes away (end of file). `cpu_threads`: torch's thread count here (None: torch's default)."""
    import torch

    from heron.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    # Ctrl-C reaches the whole process group: the API process decides when the engine stops (it drains
    # requests first), and tells it with "shutdown" or by closing the pipe.
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
            config.scheduler.max_num_seqs,
        )
        events.send(("ready", info))
        _serve(engine, commands, events)
    except (EOFError, BrokenPipeError):
        return
    except BaseException as e:  # noqa: BLE001 - the API process must hear why, then this process exits
        logger.error("engine failed:\n%s", traceback.format_exc())
        try:
            events.send(("dead", f"{type(e).__name__}: {e}"))
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
            if msg[0] == "shutdown":
                return
            if msg[0] == "abort":
                engine.abort(msg[1])
                if not engine.has_unfinished():  # the stats the API process shows must see the freed blocks
                    events.send(("outputs", [], engine.get_stats()))
                continue
            _, rid, prompt, prompt_ids, params, priority, add_special = msg
            try:
                params.verify_vocab(engine.model_cfg.vocab_size)
                engine.add_request(
                    rid,
                    prompt,
                    replace(params, output_kind=RequestOutputKind.DELTA),
                    priority=priority,
                    add_special_tokens=add_special,
                    prompt_token_ids=prompt_ids,
                )
                events.send(("added", rid, None))
            except Exception as e:  # noqa: BLE001 - the caller gets it as the answer to its request
                events.send(("added", rid, (type(e).__name__, str(e))))
        if engine.has_unfinished():
            out = engine.output_processor
            events.send(("outputs", [to_wire(r, out) for r in engine.advance()], engine.get_stats()))


def to_wire(request: Request, outputs: OutputProcessor) -> tuple:
    """The request's news since its previous wire output (the format is in this module's docstring)."""
    m = request.metrics
    first = None
    if not request.sent_prompt:
        request.sent_prompt = True
        first = (request.prompt_logprobs, request.seqs[0].num_cached_tokens)
    return (
        request.request_id,
        request.is_finished,
        (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time),
        [outputs.news(s) for s in request.seqs],
        first,
    )


class OutputAccumulator:
    """The API process's side: folds a request's delta outputs into its state (on the event loop's thread)
    and makes cumulative RequestOutputs of it on demand. Each snapshot is a new object: a reader holding
    one across an await must not see it change."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.head = (request_id, prompt, prompt_token_ids)
        self.prompt_logprobs: list | None = None
        self.num_cached_tokens = 0
        self.state: tuple = ()  # finished, metrics
        self.completions: dict[int, CompletionOutput] = {}

    def add(self, wire: tuple) -> None:
        _, finished, metrics, completions, first = wire
        if first is not None:
            self.prompt_logprobs, self.num_cached_tokens = first
        self.state = (finished, metrics)
        for index, text, ids, cum_lp, lps, finish_reason, stop_reason in completions:
            c = self.completions.get(index)
            if c is None:
                c = self.completions[index] = CompletionOutput(index, "", [], None, [] if lps is not None else None)
            c.text += text
            c.token_ids += ids
            if lps is not None:
                c.logprobs += lps
            c.cumulative_logprob, c.finish_reason, c.stop_reason = cum_lp, finish_reason, stop_reason

    def snapshot(self) -> RequestOutput:
        finished, metrics = self.state
        outputs = [
            CompletionOutput(
                c.index,
                c.text,
                list(c.token_ids),
                c.cumulative_logprob,
                None if c.logprobs is None else list(c.logprobs),
                c.finish_reason,
                c.stop_reason,
            )
            for _, c in sorted(self.completions.items())
        ]
        return RequestOutput(
            *self.head, self.prompt_logprobs, outputs, finished, RequestMetrics(*metrics), self.num_cached_tokens
        )
