"""`--gpu-monitor`: what the GPU did while a benchmark ran, the figures `nvidia-smi dmon` shows (utilisation,
memory used, power, SM clock), sampled through NVML (nvidia-ml-py) every 100 ms in a thread of the benchmark's
process, so a result says whether the GPU was busy and at what clock, not only how fast the run was.

The result gets `gpu_monitor` = {"summary": mean / max of each figure, "series": at most 300 evenly spaced
samples}. On a machine without an NVIDIA GPU or without nvidia-ml-py the flag says so and the run goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FIELDS = ("gpu_util_pct", "memory_used_mib", "power_w", "sm_clock_mhz")
MAX_POINTS = 300


class GpuMonitor:
    """Samples `read()` (one value per field of FIELDS) every `interval_s` between __enter__ and __exit__."""

    def __init__(self, read: Callable[[], tuple[float, ...]], interval_s: float = 0.1, name: str = "") -> None:
        self.read, self.interval_s, self.name = read, interval_s, name
        self.times: list[float] = []
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, device_index: int = 0, interval_s: float = 0.1) -> GpuMonitor | None:
        """A monitor of the NVIDIA GPU `device_index` through NVML, or None where NVML is not available."""
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            name = pynvml.nvmlDeviceGetName(handle)
        except Exception:  # no package, no driver, no such device: NVML raises its own error classes
            return None

        def read() -> tuple[float, ...]:
            return (
                float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            )

        return cls(read, interval_s, name if isinstance(name, str) else name.decode())

    def __enter__(self) -> GpuMonitor:
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="heron-gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.times.append(time.perf_counter() - self._start)
            self.samples.append(self.read())
            if self._stop.wait(self.interval_s):
                return

    def summary(self) -> dict:
        columns = list(zip(*self.samples)) or [()] * len(FIELDS)
        out: dict = {"device": self.name, "samples": len(self.samples), "interval_s": self.interval_s}
        for field, values in zip(FIELDS, columns):
            out[f"{field}_mean"] = sum(values) / len(values) if values else None
            out[f"{field}_max"] = max(values) if values else None
        return out

    def series(self, max_points: int = MAX_POINTS) -> dict:
        """Evenly spaced samples (every k-th), so a long run's record stays small."""
        step = max(1, -(-len(self.samples) // max_points))
        picked = range(0, len(self.samples), step)
        out = {"t_s": [round(self.times[i], 2) for i in picked]}
        for j, field in enumerate(FIELDS):
            out[field] = [round(self.samples[i][j], 1) for i in picked]
        return out

    def record(self) -> dict:
        return {"summary": self.summary(), "series": self.series()}


def maybe_monitor(enabled: bool) -> GpuMonitor | None:
    """The monitor `--gpu-monitor` asks for, or None (with a line saying why) where there is no GPU to watch."""
    if not enabled:
        return None
    monitor = GpuMonitor.open()
    if monitor is None:
        print("--gpu-monitor: no NVIDIA GPU reachable through NVML (nvidia-ml-py) here; running without it.")
    return monitor


def format_summary(record: dict) -> str:
    s = record["summary"]
    if not s["samples"]:
        return "GPU monitor: no samples"
    return (
        f"GPU monitor ({s['device']}, {s['samples']} samples): utilisation {s['gpu_util_pct_mean']:.0f}% mean, "
        f"memory {s['memory_used_mib_max']:,.0f} MiB max, power {s['power_w_mean']:.0f} W mean / "
        f"{s['power_w_max']:.0f} max, SM clock {s['sm_clock_mhz_mean']:.0f} MHz mean"
    )
