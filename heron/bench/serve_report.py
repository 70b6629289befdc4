"""What a serving benchmark run reports: the summary metrics, the printed block, the JSON result with
per-request detail, and for a sweep a plot of TTFT and TPOT percentiles against achieved throughput with
a Markdown report beside it.

A run's result follows report.py's recorded-result convention (name, date, gpu, commit, command, metrics)
and adds config (what was asked), metadata (--metadata), errors ({message: count}) and requests (one
entry a request). Metrics are flat, in milliseconds for latencies: completed, failed, duration_s,
input_tokens, output_tokens, requests_per_s, output_tokens_per_s, total_tokens_per_s, peak_concurrency,
goodput_requests_per_s (None without --goodput), offline_output_tokens_per_s and ratio_vs_offline
(with --offline-result), then for each of ttft, tpot, itl, e2el: _mean_ms,
_median_ms, _std_ms and one _p<P>_ms per --metric-percentiles (ttft_p99_ms, ...). Every metric is in the
JSON; --percentile-metrics chooses the printed ones.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def api_url(base_url: str, path: str) -> str:
    """'http://h:8000' or 'http://h:8000/v1' (as the openai SDK takes it) + '/v1/...'."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return base + path


def latency_samples(results) -> dict[str, list[float]]:
    """Seconds, from the successful requests: TPOT of those with two tokens at least, every ITL gap pooled."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def peak_concurrency(results) -> int:
    """The most requests in flight at once (sent, not yet ended), failed ones included."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results])  # ends first on a tie
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def meets_slos(r, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return r.success and all(values[m] is None or values[m] * 1000 <= limit for m, limit in slos_ms.items())


def summarize(results, duration: float, percentiles: list[float], slos_ms: dict[str, float]) -> dict:
    import numpy as np

    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (input_tokens + output_tokens) / duration,
        "peak_concurrency": peak_concurrency(results),
        "goodput_requests_per_s": sum(meets_slos(r, slos_ms) for r in ok) / duration if slos_ms else None,
    }
    for name, samples in latency_samples(results).items():
        ms = np.asarray(samples, dtype=np.float64) * 1000
        m[f"{name}_mean_ms"] = float(ms.mean()) if ms.size else None
        m[f"{name}_median_ms"] = float(np.median(ms)) if ms.size else None
        m[f"{name}_std_ms"] = float(ms.std()) if ms.size else None
        for p in percentiles:
            m[f"{name}_p{p:g}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return m


def error_summary(results) -> dict[str, int]:
    """{error message: count}, the most frequent first."""
    return dict(collections.Counter(r.error for r in results if not r.success).most_common())


def request_detail(r, t0: float) -> dict:
    ms = lambda s: None if s is None else round(s * 1000, 3)
    return {
        "index": r.index,
        "success": r.success,
        "status": r.status,
        "error": r.error,
        "start_s": round(r.start - t0, 6),
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "output_tokens": r.output_tokens,
        "output_tokens_source": r.output_tokens_source,
        "usage": r.usage,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2el_ms": ms(r.e2el),
        "itl_ms": [ms(g) for g in r.itl],
    }


def make_run_result(
    name: str,
    results,
    duration: float,
    config: dict,
    metadata: dict,
    offline_tokens_per_s: float | None = None,
    detailed: bool = False,
) -> dict:
    """Summary figures and an error summary; the per-request timings only when `detailed` (they are large:
    recorded results keep summaries)."""
    import torch

    from heron.bench.report import make_result

    metrics = summarize(results, duration, config["metric_percentiles"], config["goodput_ms"])
    if offline_tokens_per_s is not None:  # what the HTTP layer costs: 1.0 means nothing
        metrics.update(
            offline_output_tokens_per_s=offline_tokens_per_s,
            ratio_vs_offline=metrics["output_tokens_per_s"] / offline_tokens_per_s,
        )
    # The GPU of the machine the client runs on: the server's when both run on one host, as recorded runs do.
    result = make_result(name, metrics, "cuda" if torch.cuda.is_available() else "cpu")
    t0 = min(r.start for r in results)
    result.update(config=config, metadata=metadata, errors=error_summary(results))
    if detailed:
        result["requests"] = [request_detail(r, t0) for r in results]
    return result


def save_result(result: dict, result_dir: str) -> Path:
    from heron.bench.report import save_result as save

    return save(result, result_dir)


def format_run(result: dict) -> str:
    """The printed block, shaped as vLLM's `benchmark_serving` prints it, so its readers know where to look."""
    m, config = result["metrics"], result["config"]
    rate = config["request_rate"]
    lines = [
        "{:=^60}".format(" Serving Benchmark Result "),
        *_rows(
            [
                ("Request rate (req/s)", rate if rate == "inf" else f"{rate:g}"),
                ("Max concurrency", config["max_concurrency"] or "-"),
                ("Successful requests", m["completed"]),
                ("Failed requests", m["failed"]),
                ("Benchmark duration (s)", m["duration_s"]),
                ("Total input tokens", m["input_tokens"]),
                ("Total generated tokens", m["output_tokens"]),
                ("Request throughput (req/s)", m["requests_per_s"]),
                ("Output token throughput (tok/s)", m["output_tokens_per_s"]),
                ("Total token throughput (tok/s)", m["total_tokens_per_s"]),
                ("Peak concurrent requests", m["peak_concurrency"]),
            ]
        ),
    ]
    if "ratio_vs_offline" in m:
        lines += _rows(
            [
                ("Offline output throughput (tok/s)", m["offline_output_tokens_per_s"]),
                ("Served / offline output throughput", m["ratio_vs_offline"]),
            ]
        )
    if m["goodput_requests_per_s"] is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in config["goodput_ms"].items())
        lines += _rows([(f"Request goodput (req/s, {slos})", m["goodput_requests_per_s"])])
    for name in config["percentile_metrics"]:
        label = name.upper()
        lines.append(f"{METRIC_NAMES[name]:-^60}")
        stats = [("Mean", "mean"), ("Median", "median"), ("Std", "std")]
        stats += [(f"P{p:g}", f"p{p:g}") for p in config["metric_percentiles"]]
        lines += _rows([(f"{title} {label} (ms)", m[f"{name}_{key}_ms"]) for title, key in stats])
    if result["errors"]:
        lines.append("{:-^60}".format(" Errors "))
        lines += [f"{count:>6} x {message[:300]}" for message, count in result["errors"].items()]
    lines.append("=" * 60)
    return "\n".join(lines)


def _rows(pairs) -> list[str]:
    return [f"{title + ':':<44}{_value(v):>16}" for title, v in pairs]


def _value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


# -- a sweep: one plot and one Markdown report over its runs -------------------------------------------------


def write_sweep(runs: list[dict], name: str, result_dir: str) -> tuple[Path, Path]:
    """<result_dir>/<name>-sweep.png and <name>-sweep.md."""
    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / f"{name}-sweep.png", out / f"{name}-sweep.md"
    plot_sweep(runs, png)
    md.write_text(sweep_markdown(runs, name, png.name))
    return png, md


def plot_sweep(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    percentiles = runs[0]["config"]["metric_percentiles"]
    x = [r["metrics"]["output_tokens_per_s"] for r in runs]
    monitored = all("gpu_monitor" in r for r in runs)
    fig, axes = plt.subplots(1, 3 if monitored else 2, figsize=(18 if monitored else 12, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for p in percentiles:
            y = [r["metrics"][f"{metric}_p{p:g}_ms"] for r in runs]
            y = [math.nan if v is None else v for v in y]
            ax.plot(x, y, marker="o", label=f"P{p:g}")
        for xi, r in zip(x, runs):  # each point's asked rate, so a reader can map it back to the table
            rate = r["config"]["request_rate"]
            label = f"{rate if rate == 'inf' else format(rate, 'g')} req/s"
            ax.annotate(
                label,
                (xi, 0),
                xycoords=("data", "axes fraction"),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=7,
                color="gray",
            )
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(METRIC_NAMES[metric])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    if monitored:
        plot_gpu_monitor(axes[2], runs)
    config = runs[0]["config"]
    fig.suptitle(f"{config['model']} at {api_url(config['base_url'], config['endpoint'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gpu_monitor(ax, runs: list[dict]) -> None:
    """GPU utilisation (left axis) and power (right axis) over each run's time, one line per rate."""
    power_ax = ax.twinx()
    for r in runs:
        s = r["gpu_monitor"]["series"]
        rate = r["config"]["request_rate"]
        label = f"{rate if rate == 'inf' else format(rate, 'g')} req/s"
        (line,) = ax.plot(s["t_s"], s["gpu_util_pct"], label=label)
        power_ax.plot(s["t_s"], s["power_w"], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("time in the run (s)")
    ax.set_ylabel("GPU utilisation (%, solid)")
    power_ax.set_ylabel("power (W, dashed)")
    ax.set_ylim(0, 105)
    ax.set_title("GPU monitor (NVML, 100 ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def sweep_markdown(runs: list[dict], name: str, png_name: str) -> str:
    from heron.bench.report import format_table

    first, config = runs[0], runs[0]["config"]
    percentiles = config["metric_percentiles"]
    headers = ["rate (req/s)", "completed", "failed", "req/s", "output tok/s", "total tok/s", "peak conc."]
    if config["goodput_ms"]:
        headers.append("goodput (req/s)")
    for metric in config["percentile_metrics"]:
        headers += [f"{metric.upper()} P{p:g} (ms)" for p in percentiles]
    rows = []
    for r in runs:
        m, rate = r["metrics"], r["config"]["request_rate"]
        row = [
            rate if rate == "inf" else float(rate),
            m["completed"],
            m["failed"],
            m["requests_per_s"],
            m["output_tokens_per_s"],
            m["total_tokens_per_s"],
            m["peak_concurrency"],
        ]
        if config["goodput_ms"]:
            row.append(m["goodput_requests_per_s"])
        for metric in config["percentile_metrics"]:
            row += [m[f"{metric}_p{p:g}_ms"] for p in percentiles]
        rows.append(tuple(row))
    workload = (
        f"{config['dataset_name']} workload, {config['num_prompts']} requests a rate, burstiness "
        f"{config['burstiness']:g}, max concurrency {config['max_concurrency'] or 'none'}"
    )
    if config["goodput_ms"]:
        workload += ", goodput SLOs " + " ".join(f"{k} <= {v:g} ms" for k, v in config["goodput_ms"].items())
    errors = collections.Counter()
    for r in runs:
        errors.update(r["errors"])
    lines = [
        f"# Serving sweep: {name}",
        "",
        f"`{config['model']}` at {api_url(config['base_url'], config['endpoint'])}; {workload}.",
        f"{first['date']}, {first['gpu']}, commit {first['commit'][:12]}.",
        "",
        f"    {first['command']}",
        "",
        format_table(rows, tuple(headers)),
        "",
        f"![TTFT and TPOT percentiles against achieved throughput]({png_name})",
        "",
    ]
    if errors:
        lines += ["## Errors", "", *(f"- {count} x {message[:300]}" for message, count in errors.most_common()), ""]
    return "\n".join(lines)
