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
Requests run with RequestOutputKind.DELTA, so a step's message carries only its new tokens and text; a wire
output is a tuple (see `to_wire`), several times cheaper to pickle than the dataclasses.
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from heron.config import EngineConfig
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


def run_engine_core(config: EngineConfig, commands: Connection, events: Connection) -> None:
    """The engine process's main: load, announce, then serve the pipes until told to stop or the API
    process goes away (end of file)."""
    from heron.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the API process decides when the engine stops (it drains
    # requests first), and tells it with "shutdown" or by closing the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = None
    try:
        engine = LLMEngine(config)
        events.send(("ready", ServingInfo(engine.model_name, engine.max_model_len, engine.tokenizer,
                                          engine.generation_defaults)))
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
                engine.add_request(rid, prompt, replace(params, output_kind=RequestOutputKind.DELTA),
                                   priority=priority, add_special_tokens=add_special, prompt_token_ids=prompt_ids)
                events.send(("added", rid, None))
            except Exception as e:  # noqa: BLE001 - the caller gets it as the answer to its request
                events.send(("added", rid, (type(e).__name__, str(e))))
        if engine.has_unfinished():
            outputs = engine.step()
            events.send(("outputs", [to_wire(o) for o in outputs], engine.get_stats()))


def to_wire(out: RequestOutput) -> tuple:
    m = out.metrics
    return (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished,
            out.num_cached_tokens,
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time),
            [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
             for c in out.outputs])


class OutputAccumulator:
    """The API process's side: folds a request's delta outputs into its state (on the event loop's thread)
    and makes cumulative RequestOutputs of it on demand. Each snapshot is a new object: a reader holding
    one across an await must not see it change."""

    def __init__(self) -> None:
        self.head: tuple | None = None  # request_id, prompt, prompt_token_ids, prompt_logprobs
        self.state: tuple = ()  # finished, num_cached_tokens, metrics
        self.completions: dict[int, CompletionOutput] = {}

    def add(self, wire: tuple) -> None:
        rid, prompt, prompt_ids, prompt_lps, finished, cached, metrics, completions = wire
        if self.head is None:
            self.head = (rid, prompt, prompt_ids, prompt_lps)
        self.state = (finished, cached, metrics)
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
        finished, cached, metrics = self.state
        outputs = [CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                    None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
                   for _, c in sorted(self.completions.items())]
        return RequestOutput(*self.head, outputs, finished, RequestMetrics(*metrics), cached)
