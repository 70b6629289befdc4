import itertools
import time

import pytest

from heron.bench.gpu_monitor import FIELDS, GpuMonitor, format_summary, maybe_monitor
from heron.bench.serve_report import plot_gpu_monitor


def counting_monitor(interval_s: float = 0.005) -> GpuMonitor:
    """A monitor whose 'GPU' reads 0, 1, 2, ... in every field (field j adds j)."""
    counter = itertools.count()

    def read() -> tuple[float, ...]:
        k = next(counter)
        return tuple(float(k + j) for j in range(len(FIELDS)))

    return GpuMonitor(read, interval_s, "fake")


def test_samples_between_enter_and_exit_and_summarises_them():
    monitor = counting_monitor()
    with monitor:
        time.sleep(0.1)
    n = len(monitor.samples)
    assert n >= 5 and len(monitor.times) == n and monitor.times == sorted(monitor.times)
    s = monitor.summary()
    assert s["samples"] == n and s["device"] == "fake"
    # the k-th sample read k (+ j for field j): mean (n - 1) / 2 + j, max n - 1 + j
    for j, field in enumerate(FIELDS):
        assert s[f"{field}_mean"] == pytest.approx((n - 1) / 2 + j) and s[f"{field}_max"] == n - 1 + j
    frozen = len(monitor.samples)
    time.sleep(0.03)
    assert len(monitor.samples) == frozen  # the thread stopped at exit
    assert "fake" in format_summary(monitor.record())


def test_series_keeps_at_most_max_points_evenly_spaced():
    monitor = counting_monitor()
    monitor.times = [i * 0.1 for i in range(1000)]
    monitor.samples = [(float(i),) * len(FIELDS) for i in range(1000)]
    series = monitor.series(max_points=300)
    assert len(series["t_s"]) <= 300 and series["gpu_util_pct"][0] == 0.0
    steps = {b - a for a, b in zip(series["gpu_util_pct"], series["gpu_util_pct"][1:])}
    assert steps == {4.0}  # every 4th of 1,000 samples: 250 points
    assert set(series) == {"t_s", *FIELDS}


def test_no_gpu_here_means_no_monitor_and_a_line_saying_so(capsys):
    assert maybe_monitor(False) is None
    assert maybe_monitor(True) is None  # this machine has no NVIDIA GPU
    assert "no NVIDIA GPU" in capsys.readouterr().out


def test_the_sweep_plot_draws_each_runs_utilisation():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for rate in (8.0, "inf"):
        monitor = counting_monitor()
        monitor.times, monitor.samples = [0.0, 0.1, 0.2], [(50.0, 1e3, 300.0, 1980.0)] * 3
        runs.append({"config": {"request_rate": rate}, "gpu_monitor": monitor.record()})
    fig, ax = plt.subplots()
    plot_gpu_monitor(ax, runs)
    assert [line.get_label() for line in ax.lines] == ["8 req/s", "inf req/s"]
    plt.close(fig)
