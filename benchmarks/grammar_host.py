"""The host's grammar work of a structured-output step on the CPU, as the engine does it: N sequences (default
256) under the `structured` workload's JSON schema (heron/bench/structured.py) with the embedded model's SmolLM2
tokenizer, on logits as wide as Qwen3-0.6B's (151,936: the `structured-qwen3-0.6b` record's shapes), through the
engine's own StructuredOutputManager: `accept` (a step's tokens to their matchers, as
LLMEngine._accept_grammar) then `fill_bitmask` (the next step's masks, as LLMEngine._grammar_masks), with each
--threads count (default 1 and 2). Reports microseconds per accepted token and milliseconds per step for each,
and whether xgrammar's `accept_token` runs in parallel on n threads (the GIL released: ~n x tokens/s on n free
cores; the process's CPU time over wall time above 1 shows that the threads overlapped at all). Then a small
step's fill (4 and 16 rows) on the calling thread against a hand-off to the fill thread.

The token sequences are made first, untimed: every sequence walks its mask, drawing uniformly (seeded) among
the allowed tokens, until its object closes (EOS) or --max-tokens; the timed replay feeds the same tokens to
fresh matchers. A shared, busy machine inflates wall times: the thread CPU time is printed beside them.

    PYTHONPATH=. python benchmarks/grammar_host.py [--num-seqs 256] [--max-tokens 200] [--vocab-size 151936] \
        [--threads 1 2] [--tokenizer DIR] [--save-result]

--save-result records benchmarks/results/cpu-grammar-host.json (its "gpu" field says "cpu").
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import torch

from heron.bench.report import finish
from heron.bench.structured import SCHEMA
from heron.engine import structured_output
from heron.engine.structured_output import StructuredOutputManager
from heron.sampling_params import StructuredOutputsParams


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from heron.models.loader import embedded_model_path

    gguf = embedded_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


def walk(manager: StructuredOutputManager, compiled, stop: list[int], n: int, max_tokens: int, vocab: int, seed: int):
    """n token sequences valid under the grammar: each step draws uniformly among the mask's allowed tokens."""
    rng = np.random.default_rng(seed)
    matchers = [manager.matcher(compiled, stop) for _ in range(n)]
    seqs: list[list[int]] = [[] for _ in range(n)]
    live = list(range(n))
    for _ in range(max_tokens):
        if not live:
            break
        mask = manager.fill_bitmask([matchers[i] for i in live]).numpy()
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = [int(rng.choice(np.flatnonzero(bits[row]))) for row in range(len(live))]
        done = manager.accept([matchers[i] for i in live], tokens)
        for i, token in zip(live, tokens):
            seqs[i].append(token)
        live = [i for i, d in zip(live, done) if not d]
    return seqs


def replay(manager: StructuredOutputManager, compiled, stop: list[int], seqs: list[list[int]]) -> dict:
    """The engine's per-step calls over the sequences: seconds (wall and this thread's CPU) in accept and fill."""
    matchers = [manager.matcher(compiled, stop) for _ in seqs]
    wall = {"accept": 0.0, "fill": 0.0}
    cpu = {"accept": 0.0, "fill": 0.0}
    steps = max(map(len, seqs))
    for k in range(steps):
        live = [i for i, s in enumerate(seqs) if k < len(s)]
        w, c = time.perf_counter(), time.thread_time()
        done = manager.accept([matchers[i] for i in live], [seqs[i][k] for i in live])
        wall["accept"] += time.perf_counter() - w
        cpu["accept"] += time.thread_time() - c
        if not all(d == (k == len(seqs[i]) - 1 and seqs[i][k] in stop) for i, d in zip(live, done)):
            raise RuntimeError("the replay's matchers did not end where the walk's did")
        w, c = time.perf_counter(), time.thread_time()
        manager.fill_bitmask([matchers[i] for i, d in zip(live, done) if not d])
        wall["fill"] += time.perf_counter() - w
        cpu["fill"] += time.thread_time() - c
    return {"steps": steps, "wall": wall, "cpu": cpu}


def raw_accept(manager, compiled, stop: list[int], seqs: list[list[int]], threads: int) -> tuple[float, float]:
    """xgrammar's accept_token alone, the sequences split between `threads` Python threads: tokens/s, and the
    process's CPU time over the wall time (above 1 only if the threads ran at once, outside the GIL)."""
    matchers = [manager.matcher(compiled, stop) for _ in seqs]

    def run(part: range) -> None:
        for i in part:
            m = matchers[i]
            for token in seqs[i]:
                m.accept_token(token)

    workers = [threading.Thread(target=run, args=(range(t, len(seqs), threads),)) for t in range(threads)]
    start, cpu = time.perf_counter(), time.process_time()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - start
    return sum(map(len, seqs)) / wall, (time.process_time() - cpu) / wall


def small_fills(manager: StructuredOutputManager, compiled, stop: list[int], seqs: list[list[int]]) -> dict:
    """A small step's fill as the engine calls it (`fill_bitmask_async(...).result()`), at 4 and 16 rows: on the
    calling thread (the default under MIN_THREAD_FILL_ROWS) against a hand-off to the fill thread, alternated,
    microseconds (median of 200 each)."""
    out, default = {}, structured_output.MIN_THREAD_FILL_ROWS
    for n in (4, 16):
        matchers = [manager.matcher(compiled, stop) for _ in range(n)]
        manager.accept(matchers, [s[0] for s in seqs[:n]])
        times: dict[str, list[float]] = {"inline": [], "thread": []}
        for _ in range(200):
            for mode, rows in (("inline", default), ("thread", 0)):
                structured_output.MIN_THREAD_FILL_ROWS = rows
                start = time.perf_counter()
                manager.fill_bitmask_async(matchers).result()
                times[mode].append(time.perf_counter() - start)
        out[n] = {mode: float(np.median(t)) * 1e6 for mode, t in times.items()}
    structured_output.MIN_THREAD_FILL_ROWS = default
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=151936, help="the logits' width (Qwen3-0.6B's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", help="a tokenizer folder (default: the embedded model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", action="store_true")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    stop = [tokenizer.eos_token_id]
    params = StructuredOutputsParams(json=SCHEMA)
    walker = StructuredOutputManager(tokenizer, args.vocab_size, args.num_seqs, torch.device("cpu"))
    seqs = walk(
        walker, walker.compile(params).result(), stop, args.num_seqs, args.max_tokens, args.vocab_size, args.seed
    )
    tokens = sum(map(len, seqs))
    metrics = {"num_seqs": args.num_seqs, "vocab_size": args.vocab_size, "tokens": tokens, "cpu_count": os.cpu_count()}
    rows = [f"{args.num_seqs} sequences, {tokens} tokens ({tokens / args.num_seqs:.0f} each), logits {args.vocab_size}"]
    rates = {}
    for n in args.threads:
        manager = StructuredOutputManager(tokenizer, args.vocab_size, args.num_seqs, torch.device("cpu"), threads=n)
        compiled = manager.compile(params).result()
        replay(manager, compiled, stop, seqs[:8])  # warm-up
        r = replay(manager, compiled, stop, seqs)
        per_token_us = r["wall"]["accept"] / tokens * 1e6
        # "per step": per full step of num_seqs rows (the replay's steps thin out as sequences end)
        full_steps = tokens / args.num_seqs
        accept_ms, fill_ms = (r["wall"][k] / full_steps * 1e3 for k in ("accept", "fill"))
        rates[n], parallel = raw_accept(manager, compiled, stop, seqs, n)
        metrics[f"threads{n}"] = {
            "accept_us_per_token": per_token_us,
            "accept_ms_per_step": accept_ms,
            "fill_ms_per_step": fill_ms,
            "accept_cpu_us_per_token": r["cpu"]["accept"] / tokens * 1e6,
            "fill_cpu_ms_per_step": r["cpu"]["fill"] / full_steps * 1e3,
            "raw_accept_token_tokens_per_s": rates[n],
            "raw_accept_token_cpu_over_wall": parallel,
        }
        rows.append(
            f"threads {n}: accept {per_token_us:.2f} us/token = {accept_ms:.2f} ms/step"
            f" (this thread's CPU {r['cpu']['accept'] / tokens * 1e6:.2f} us/token), fill {fill_ms:.2f} ms/step;"
            f" raw accept_token on {n} thread(s): {rates[n]:,.0f} tokens/s, CPU/wall {parallel:.2f}"
        )
    small = small_fills(walker, walker.compile(params).result(), stop, seqs)
    metrics["small_step_fill_us"] = small
    rows.append(
        "a small step's fill: "
        + ", ".join(
            f"{n} rows {t['inline']:.0f} us inline, {t['thread']:.0f} through the thread" for n, t in small.items()
        )
    )
    for n in rates:
        if n > 1 and 1 in rates:
            metrics[f"accept_token_{n}_threads_speedup"] = rates[n] / rates[1]
            rows.append(
                f"accept_token on {n} threads: {rates[n] / rates[1]:.2f}x one thread's tokens/s (~{n}x: the GIL is"
                f" released and {n} cores free; CPU/wall above 1 shows the threads overlapped)"
            )
    finish("cpu-grammar-host", metrics, "cpu", "\n".join(rows), args.save_result)


if __name__ == "__main__":
    main()
