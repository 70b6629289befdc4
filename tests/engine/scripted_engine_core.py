"""A stand-in for the engine process whose behaviour each request's prompt scripts, so that tests of
`AsyncLLM` can decide when the engine's acknowledgement arrives (or that it never does), instead of
hoping for a timing. The first prompt token picks the script:

  LATE_ACK   acknowledge the request only once its abort arrives (the client gave up first)
  NO_ACK     never acknowledge it
  STREAM     acknowledge, then send prompt[1] tokens and finish
  HANG       acknowledge, send one token, then nothing more (a request in flight)
  REJECT     reject it as the engine rejects an invalid request
  DIE        the engine fails: it reports why and exits
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

from heron.engine.messages import (
    AbortRequest,
    Added,
    EngineDead,
    Ready,
    RequestDelta,
    ServingInfo,
    Shutdown,
    StepOutputs,
)
from heron.stats import EngineStats

LATE_ACK, NO_ACK, STREAM, HANG, REJECT, DIE = 1, 2, 3, 4, 5, 6
TOKEN = 7  # every token the stand-in "generates"


def run_scripted_core(config, commands: Connection, events: Connection, *_) -> None:
    events.send(Ready(ServingInfo("scripted", 64, None, {}, vocab_size=100, max_num_seqs=8)))
    late: set[str] = set()
    while True:
        msg = commands.recv()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, AbortRequest):
            if msg.request_id in late:
                late.discard(msg.request_id)
                events.send(Added(msg.request_id, None))
            continue
        rid, script = msg.request_id, msg.prompt[0]
        if script == LATE_ACK:
            late.add(rid)
        elif script == REJECT:
            events.send(Added(rid, ("ValueError", "max_tokens (99) is too many for this stand-in.")))
        elif script == DIE:
            events.send(EngineDead("RuntimeError: scripted engine failure"))
            return
        elif script in (STREAM, HANG):
            events.send(Added(rid, None))
            count = msg.prompt[1] if script == STREAM else 1
            for i in range(count):
                done = script == STREAM and i == count - 1
                now = time.time()
                c = (0, "x", [TOKEN], None, None, "length" if done else None, None)  # CompletionDelta's items
                delta = RequestDelta(
                    (rid, done, (now, now, now, now, now if done else None), [c], i == 0, None, 0, None)
                )
                events.send(StepOutputs([delta], EngineStats()))
