"""Prometheus metrics and the periodic log line of a serving engine.

Gauges and counters are read from `EngineStats` when scraped, so the engine thread keeps plain integers
and never touches prometheus-client; the latency histograms are observed by the server as outputs
arrive. Each server has its own registry, so several can live in one process (the tests do)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from heron.outputs import RequestMetrics
from heron.stats import EngineStats

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector(Collector):
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats | None], admitted_waiting: Callable[[], int]
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.admitted_waiting = admitted_waiting

    def collect(self) -> Iterator:
        s = self.stats() or EngineStats()  # zeros while the model loads
        label = [self.model_name]

        def family(cls, name: str, doc: str, value: float):
            f = cls(name, doc, labels=["model_name"])
            f.add_metric(label, value)
            return f

        yield family(GaugeMetricFamily, "heron:num_requests_running", "Sequences running now.", s.num_running)
        yield family(
            GaugeMetricFamily, "heron:num_requests_waiting", "Sequences waiting or swapped out.", s.num_waiting
        )
        yield family(
            GaugeMetricFamily,
            "heron:api_requests_waiting",
            "Prompts the server accepted that have no output yet (what --max-waiting-requests bounds).",
            self.admitted_waiting(),
        )
        yield family(
            GaugeMetricFamily,
            "heron:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1).",
            s.kv_cache_usage,
        )
        yield family(CounterMetricFamily, "heron:prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield family(CounterMetricFamily, "heron:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield family(CounterMetricFamily, "heron:num_preemptions", "Sequences preempted.", s.num_preemptions)
        yield family(
            CounterMetricFamily,
            "heron:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield family(
            CounterMetricFamily,
            "heron:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        )
        success = CounterMetricFamily(
            "heron:request_success", "Requests finished, by finish reason.", labels=["model_name", "finished_reason"]
        )
        finished = dict(s.finished)  # a copy: the engine thread may add a reason meanwhile
        for reason in sorted(set(_FINISH_REASONS) | set(finished)):
            success.add_metric([self.model_name, reason], finished.get(reason, 0))
        yield success


class ServerMetrics:
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats | None], admitted_waiting: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats, admitted_waiting))

        def histogram(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)
            return h.labels(model_name)

        self.ttft = histogram("heron:time_to_first_token_seconds", "From arrival to the first token.")
        self.itl = histogram("heron:inter_token_latency_seconds", "Between two tokens of a sequence.")
        self.e2e = histogram("heron:e2e_request_latency_seconds", "From arrival to the last token.")
        self.queue = histogram("heron:request_queue_time_seconds", "From arrival to the first scheduling.")

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` more tokens came `seconds` after the previous ones. Outputs are cumulative and a slow
        reader may see several tokens at once: each gets the average gap."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def observe_finished(self, m: RequestMetrics) -> None:
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self.e2e.observe((m.finished_time or time.time()) - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """One line per interval while the engine is busy: throughput since the last line and the state now."""

    def __init__(self) -> None:
        self._last: tuple[float, int, int, int, int] | None = None

    def log(self, s: EngineStats) -> None:
        now = time.monotonic()
        cur = (now, s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits)
        last, self._last = self._last, cur
        if last is None:
            return
        dt = max(now - last[0], 1e-9)
        prompt, gen, queries, hits = (c - p for c, p in zip(cur[1:], last[1:]))
        if not (prompt or gen or s.num_running or s.num_waiting):
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s, running: %d, "
            "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            prompt / dt,
            gen / dt,
            s.num_running,
            s.num_waiting,
            100 * s.kv_cache_usage,
            100 * hits / queries if queries else 0.0,
        )
