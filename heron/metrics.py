"""Prometheus metrics and the periodic log line of a serving engine.

The names and meanings are vLLM's (`vllm/v1/metrics/loggers.py`) under `heron:`; `--metrics-compat vllm` also
exports every `heron:` family under its `vllm:` name, for dashboards and gateways (llm-d's inference
extension) that scrape those. Gauges and counters are read from `EngineStats` when scraped, so the engine
thread keeps plain integers and never touches prometheus-client; the per-request histograms are observed by
the server as outputs arrive. Each server has its own registry, so several can live in one process (the
tests do); the process collectors describe the API process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from heron.outputs import RequestMetrics
from heron.sampling_params import SamplingParams
from heron.stats import EngineStats

logger = logging.getLogger(__name__)

# vLLM's buckets, so that quantiles computed from either server compare.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TOKEN_GAP_BUCKETS += (40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_FINISH_REASONS = ("stop", "length", "abort")
COMPAT_PREFIXES = {"vllm": "vllm:"}


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        admitted_waiting: Callable[[], int],
        cache_info: dict[str, str],
        max_lora: int | None,
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.admitted_waiting = admitted_waiting
        self.cache_info = cache_info
        self.max_lora = max_lora

    def collect(self) -> Iterator[Metric]:
        loaded = self.stats()
        s = loaded or EngineStats()  # zeros while the model loads
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
        if loaded is not None:  # the number of blocks is known once the model is loaded
            info = {"model_name": self.model_name, **self.cache_info, "num_gpu_blocks": str(s.num_gpu_blocks)}
            config = GaugeMetricFamily(
                "heron:cache_config_info", "The KV cache's configuration, in labels (value 1).", labels=list(info)
            )
            config.add_metric(list(info.values()), 1)
            yield config
        if self.max_lora is not None:
            yield self._lora_info(s)

    def _lora_info(self, s: EngineStats) -> Metric:
        """vLLM's lora_requests_info, which gateways that route by adapter read: the adapters in labels
        (comma-joined names), its value the time of the reading (a reader takes the latest sample)."""
        info = GaugeMetricFamily(
            "heron:lora_requests_info",
            "Running stats on LoRA requests: the adapters with running and waiting requests, in labels.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting, running = ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)
        info.add_metric([str(self.max_lora), waiting, running], time.time())
        return info


# The engine's gauges and counters again per data-parallel replica: (family type, name, help, EngineStats field).
_PER_REPLICA = (
    (GaugeMetricFamily, "num_requests_running", "Sequences running now on the replica.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Sequences waiting or swapped out on the replica.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of the replica's KV-cache blocks in use.", "kv_cache_usage"),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens the replica received.", "prompt_tokens"),
    (CounterMetricFamily, "generation_tokens", "Tokens the replica generated.", "generation_tokens"),
    (CounterMetricFamily, "num_preemptions", "Sequences the replica preempted.", "num_preemptions"),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in the replica's prefix cache.",
        "prefix_cache_queries",
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens found in the replica's prefix cache.",
        "prefix_cache_hits",
    ),
)


class _ReplicaCollector(Collector):
    """Data parallelism: each replica's gauges and counters under `heron:replica_<name>` with a `replica` label,
    and `heron:replica_up` (1 alive, 0 dead). The unprefixed families hold their sums, as with one engine, so
    dashboards read the same names whatever the number of replicas."""

    def __init__(self, model_name: str, replica_stats: Callable[[], list[tuple[EngineStats, bool]]]) -> None:
        self.model_name = model_name
        self.replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        replicas = self.replica_stats()
        up = GaugeMetricFamily(
            "heron:replica_up", "1 while the replica serves, 0 once it has died.", labels=["model_name", "replica"]
        )
        for i, (_, alive) in enumerate(replicas):
            up.add_metric([self.model_name, str(i)], float(alive))
        yield up
        for cls, name, doc, field in _PER_REPLICA:
            family = cls(f"heron:replica_{name}", doc, labels=["model_name", "replica"])
            for i, (stats, _) in enumerate(replicas):
                family.add_metric([self.model_name, str(i)], getattr(stats, field))
            yield family


class _Renamed(Collector):
    """Every `heron:` family of `source` once more under `prefix` (samples and all); the rest only once."""

    def __init__(self, source: CollectorRegistry, prefix: str | None) -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            yield family
            if self.prefix is None or not family.name.startswith("heron:"):
                continue
            copy = Metric(self.prefix + family.name.removeprefix("heron:"), family.documentation, family.type)
            copy.samples = [s._replace(name=self.prefix + s.name.removeprefix("heron:")) for s in family.samples]
            yield copy


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        admitted_waiting: Callable[[], int],
        *,
        max_model_len: int = 1 << 20,
        cache_info: dict[str, str] | None = None,
        compat: str | None = None,
        max_lora: int | None = None,
        replica_stats: Callable[[], list[tuple[EngineStats, bool]]] | None = None,
    ) -> None:
        """`max_lora`: the engine's LoRA slots (--max-loras) when it serves adapters, else None (no LoRA
        metric); `stats`: the engine's (with data parallelism, the replicas' summed); `replica_stats`: each
        replica's and whether it is alive, with data parallelism only."""
        disable_created_metrics()  # as vLLM: no `_created` series beside every histogram (process-wide)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats, admitted_waiting, cache_info or {}, max_lora))
        if replica_stats is not None:
            self.registry.register(_ReplicaCollector(model_name, replica_stats))
        for process_collector in (ProcessCollector, PlatformCollector, GCCollector):
            process_collector(registry=self.registry)
        self.exposition = CollectorRegistry(auto_describe=False)
        self.exposition.register(_Renamed(self.registry, COMPAT_PREFIXES[compat] if compat else None))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        tokens = _one_two_five(max_model_len)
        self.ttft = histogram("heron:time_to_first_token_seconds", "From arrival to the first token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "heron:inter_token_latency_seconds", "Between two tokens of a sequence.", _TOKEN_GAP_BUCKETS
        )
        self.tpot = histogram(
            "heron:request_time_per_output_token_seconds",
            "A request's decode time over its output tokens after the first.",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram("heron:e2e_request_latency_seconds", "From arrival to the last token.", _REQUEST_BUCKETS)
        self.queue = histogram(
            "heron:request_queue_time_seconds", "From arrival to the first scheduling (WAITING).", _REQUEST_BUCKETS
        )
        self.inference = histogram(
            "heron:request_inference_time_seconds",
            "From the first scheduling to the last token (RUNNING).",
            _REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "heron:request_prefill_time_seconds", "From the first scheduling to the first token.", _REQUEST_BUCKETS
        )
        self.decode = histogram(
            "heron:request_decode_time_seconds", "From the first token to the last.", _REQUEST_BUCKETS
        )
        self.prompt_tokens = histogram("heron:request_prompt_tokens", "Prompt tokens of a request.", tokens)
        self.generation_tokens = histogram(
            "heron:request_generation_tokens", "Tokens generated for a sequence.", tokens
        )
        self.max_generation_tokens = histogram(
            "heron:request_max_num_generation_tokens",
            "The most tokens any sequence of a request generated (n > 1: the longest sample).",
            tokens,
        )
        self.params_n = histogram("heron:request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram(
            "heron:request_params_max_tokens", "The max_tokens request parameter.", tokens
        )

    def observe_params(self, params: SamplingParams) -> None:
        """A prompt entered the engine with these parameters."""
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` more tokens came `seconds` after the previous ones. Outputs are cumulative and a slow
        reader may see several tokens at once: each gets the average gap."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def observe_finished(self, m: RequestMetrics, num_prompt_tokens: int, generated: list[int]) -> None:
        """A request finished: `generated` holds each of its sequences' token counts."""
        end = m.finished_time or time.time()
        self.e2e.observe(end - m.arrival_time)
        self.prompt_tokens.observe(num_prompt_tokens)
        for n in generated:
            self.generation_tokens.observe(n)
        self.max_generation_tokens.observe(max(generated, default=0))
        last = m.last_token_time or end
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.inference.observe(last - m.first_scheduled_time)
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.decode.observe(last - m.first_token_time)
        if m.first_scheduled_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        if generated and generated[0] > 1:
            self.tpot.observe((last - m.first_token_time) / (generated[0] - 1))

    def render(self) -> bytes:
        return generate_latest(self.exposition)


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
