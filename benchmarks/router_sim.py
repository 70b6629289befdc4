"""The data-parallel router at scale, without a model: replicas as continuous-batching queues with a prefix cache,
fed a multi-turn chat trace, routed by each policy of heron/engine/router.py.

    python benchmarks/router_sim.py [--replicas 16 64 256] [--seconds 40] [--save]

The trace is ShareGPT-like: sessions arrive as a Poisson process (15 a second per replica, over `--seconds`;
turns arriving in the first 10 s or after the last session started are not counted); each picks one of 64 system prompts
(Zipf-distributed, 500-2,000 tokens), then runs 1-16 turns (geometric, mean 4): a user message of 16-256 tokens,
a reply of 32-512, a think time (exponential, mean 5 s) after the reply before the next turn, whose prompt is the
system prompt and the whole conversation so far.

A replica runs steps as Heron's engine does: every running request gains a token per step; waiting requests are
admitted while fewer than 256 run, their uncached prompt tokens prefilled in chunks of at most 8,192 a step; its
prefix cache is an LRU of 64-token blocks as large as the KV cache. A step costs
`base + per_sequence x running + per_token x prefill tokens`, with the constants from Heron's H200 records for
8B models (latency-llama3.1-8b-bs1: 4.23 ms at batch 1; offline-qwen3-8b: 256 sequences at 9,643 tokens/s;
prefill-llama3.1-8b: 42,964 prompt tokens/s) and a KV cache of 700,000 tokens (Qwen3-8B's 144 KiB a token in
~100 GB). The figures are those of the model, not measurements: what it compares is the policies.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from heron.engine.router import CacheAware, LeastLoaded, RoundRobin, Router  # noqa: E402

BLOCK = 64
BASE_S, PER_SEQ_S, PER_TOKEN_S = 4.23e-3, (256 / 9643 - 4.23e-3) / 255, 1 / 42964
MAX_RUNNING, CHUNK = 256, 8192
CACHE_BLOCKS = 700_000 // BLOCK
SESSIONS_PER_S_PER_REPLICA = 15.0  # where round robin's TTFT P99 passes a second (16 replicas)
WARMUP_S = 10.0


@dataclass
class Turn:
    session: int
    arrival: float
    hashes: list  # the prompt's full blocks
    prompt_len: int
    output_len: int
    user: str
    replica: int = -1
    todo: int = 0  # prompt tokens left to prefill
    cached: int = 0
    first_token: float = 0.0


@dataclass
class Replica:
    cache: OrderedDict = field(default_factory=OrderedDict)
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # heap of (finishing step, seq, turn)
    step: int = 0
    busy: bool = False

    def lookup_and_touch(self, hashes: list) -> int:
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)
        return hit


class Trace:
    """Sessions of turns; the next turn of a session is made when its previous reply finishes."""

    def __init__(self, rng: random.Random, sessions_per_s: float, seconds: float) -> None:
        self.rng = rng
        prompts = range(64)
        self.system = {p: rng.randint(500, 2000) for p in prompts}
        weights = [1 / (p + 1) ** 1.1 for p in prompts]
        self.starts, t, s = [], 0.0, 0
        while (t := t + rng.expovariate(sessions_per_s)) < seconds:
            turns = min(16, 1 + int(rng.expovariate(1 / 3)))
            self.starts.append((t, s, rng.choices(prompts, weights)[0], turns))
            s += 1
        self.history: dict[int, tuple[int, int, int]] = {}  # session -> (system prompt, tokens so far, turns left)

    def first(self, session: int, system: int, turns: int, now: float) -> Turn:
        self.history[session] = (system, self.system[system], turns)
        return self._turn(session, now)

    def next(self, turn: Turn, now: float) -> Turn | None:
        system, length, left = self.history[turn.session]
        if left <= 1:
            del self.history[turn.session]
            return None
        self.history[turn.session] = (system, turn.prompt_len + turn.output_len, left - 1)
        return self._turn(turn.session, now + self.rng.expovariate(1 / 5.0))

    def _turn(self, session: int, arrival: float) -> Turn:
        system, length, left = self.history[session]
        prompt = length + self.rng.randint(16, 256)
        sys_blocks = self.system[system] // BLOCK
        hashes = [("s", system, i) for i in range(sys_blocks)]
        hashes += [("c", session, i) for i in range(sys_blocks, prompt // BLOCK)]
        return Turn(session, arrival, hashes, prompt, self.rng.randint(32, 512), f"user-{session}")


def simulate(policy: str, replicas: int, seconds: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    trace = Trace(rng, SESSIONS_PER_S_PER_REPLICA * replicas, seconds)
    router: Router = {
        "round_robin": lambda: RoundRobin(replicas),
        "least_loaded": lambda: LeastLoaded(replicas),
        "cache_aware": lambda: CacheAware(replicas, CACHE_BLOCKS),
    }[policy]()
    reps = [Replica() for _ in range(replicas)]
    events: list = []  # (time, order, kind, payload)
    order = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    for t, s, system, turns in trace.starts:
        push(t, "session", (s, system, turns))
    done, seq = [], 0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "session":
            push(now, "arrive", trace.first(*payload, now))
        elif kind == "arrive":
            turn = payload
            turn.replica = router.choose(turn.hashes, turn.user)
            rep = reps[turn.replica]
            rep.waiting.append(turn)
            if not rep.busy:
                rep.busy = True
                push(now, "step", turn.replica)
        else:  # a step of replica `payload` starts now
            r = payload
            rep = reps[r]
            while rep.running and rep.running[0][0] <= rep.step:  # finished at the end of the last step
                _, _, turn = heapq.heappop(rep.running)
                router.finished(r)
                reply = range(turn.prompt_len // BLOCK, (turn.prompt_len + turn.output_len) // BLOCK)
                rep.lookup_and_touch(turn.hashes + [("c", turn.session, i) for i in reply])
                done.append(turn)
                if (nxt := trace.next(turn, now)) is not None:
                    push(nxt.arrival, "arrive", nxt)
            budget, prefilled = CHUNK, []
            while rep.waiting and budget and len(rep.running) + len(prefilled) < MAX_RUNNING:
                turn = rep.waiting[0]
                if turn.todo == 0 and turn.cached == 0:  # first look: the cache decides what is left
                    turn.cached = min(rep.lookup_and_touch(turn.hashes) * BLOCK, turn.prompt_len - 1)
                    turn.todo = turn.prompt_len - turn.cached
                take = min(turn.todo, budget)
                turn.todo -= take
                budget -= take
                if turn.todo:
                    break  # its next chunk in the next step
                rep.waiting.popleft()
                prefilled.append(turn)
            n_run = len(rep.running) + len(prefilled)
            if n_run == 0 and budget == CHUNK:
                rep.busy = False
                continue
            dt = BASE_S + PER_SEQ_S * n_run + PER_TOKEN_S * (CHUNK - budget)
            rep.step += 1
            for turn in prefilled:
                turn.first_token = now + dt
                seq += 1
                heapq.heappush(rep.running, (rep.step + turn.output_len - 1, seq, turn))
            push(now + dt, "step", r)

    measured = [t for t in done if WARMUP_S <= t.arrival < seconds]  # steady state: sessions still arriving
    ttft = sorted(t.first_token - t.arrival for t in measured)
    served = [0] * replicas
    for t in measured:
        served[t.replica] += 1
    span = seconds - WARMUP_S
    return {
        "policy": policy,
        "replicas": replicas,
        "turns": len(measured),
        "turns_per_s_per_replica": len(measured) / span / replicas,
        "cache_hit_rate": sum(t.cached for t in measured) / sum(t.prompt_len for t in measured),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[int(len(ttft) * 0.99)],
        "load_imbalance": max(served) / (sum(served) / replicas),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--save", action="store_true", help="write benchmarks/results/router-sim.{json,png}")
    args = p.parse_args()
    rows = []
    for n in args.replicas:
        for policy in ("round_robin", "least_loaded", "cache_aware"):
            rows.append(simulate(policy, n, args.seconds))
            r = rows[-1]
            print(
                f"{n:4d} replicas {policy:13s} turns {r['turns']:7d} ({r['turns_per_s_per_replica']:.1f}/s each) "
                f"hit rate {r['cache_hit_rate']:.3f} "
                f"TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms p99 {r['ttft_p99_s'] * 1e3:8.1f} ms "
                f"imbalance {r['load_imbalance']:.2f}",
                flush=True,
            )
    if args.save:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "router-sim")
        with open(out + ".json", "w") as f:
            record = {"name": "router-sim", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": "none (simulation)"}
            record |= {"commit": _commit(), "command": "python " + " ".join(sys.argv), "rows": rows}
            json.dump(record, f, indent=1)
        _plot(rows, out + ".png")


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in ("round_robin", "least_loaded", "cache_aware"):
        rs = [r for r in rows if r["policy"] == policy]
        xs = [r["replicas"] for r in rs]
        a.plot(xs, [r["cache_hit_rate"] for r in rs], marker="o", label=policy)
        b.plot(xs, [r["ttft_p99_s"] * 1e3 for r in rs], marker="o", label=policy)
    for ax, title in ((a, "prefix cache hit rate"), (b, "TTFT P99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
        ax.legend()
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
