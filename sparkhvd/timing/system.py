"""A rank's system metrics, in MLflow's own names (``mlflow.system_metrics``), so its UI shows
them: CPU and memory of the rank's process tree (psutil), the host's network bytes, and the
utilisation and memory of the GPUs the rank sees (NVML, through ``pynvml`` from
``nvidia-ml-py``, where installed and a GPU is there).

Each :meth:`SystemMetrics.read` covers the time since the last one (CPU % and network bytes
are rates over that interval).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

__side__ = "rank"


class SystemMetrics:
    """Reads the metrics of this process (and its children: DataLoader workers, a tokenizer's
    pool) and of the GPUs it may use."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.process = psutil.Process()
        self._cpu: dict[int, Any] = {}
        self._net = self._net_bytes()
        self._nvml: Any = None
        self._gpus: list[tuple[int, Any]] = []
        self._start_nvml()
        self.read()  # the first CPU reading only starts the interval

    def _start_nvml(self) -> None:
        """NVML handles of the GPUs this rank sees (``CUDA_VISIBLE_DEVICES``, else all)."""
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception:  # noqa: BLE001 - no driver, no GPU: no GPU metrics
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [int(g) for g in visible.split(",") if g.strip().isdigit()] if visible \
            else list(range(count))
        for index, gpu in enumerate(i for i in ids if i < count):
            with contextlib.suppress(Exception):
                self._gpus.append((index, pynvml.nvmlDeviceGetHandleByIndex(gpu)))
        self._nvml = pynvml

    def _processes(self) -> list[Any]:
        try:
            return [self.process, *self.process.children(recursive=True)]
        except self.psutil.Error:
            return [self.process]

    def _net_bytes(self) -> Optional[tuple[int, int]]:
        try:
            net = self.psutil.net_io_counters()
        except Exception:  # noqa: BLE001 - some containers hide /proc/net
            return None
        return (net.bytes_recv, net.bytes_sent) if net is not None else None

    def read(self) -> dict[str, float]:
        """The metrics now (CPU % and network bytes since the last call)."""
        out: dict[str, float] = {}
        cpu = rss = 0.0
        seen: dict[int, Any] = {}
        for proc in self._processes():
            try:
                known = self._cpu.get(proc.pid, proc)
                cpu += known.cpu_percent(None)
                rss += proc.memory_info().rss
                seen[proc.pid] = known
            except self.psutil.Error:
                continue
        self._cpu = seen
        out["cpu_utilization_percentage"] = round(cpu, 1)
        out["rss_megabytes"] = round(rss / 1e6, 1)
        with contextlib.suppress(Exception):
            out["system_memory_usage_percentage"] = self.psutil.virtual_memory().percent
        net = self._net_bytes()
        if net is not None and self._net is not None:
            out["network_receive_megabytes"] = round((net[0] - self._net[0]) / 1e6, 3)
            out["network_transmit_megabytes"] = round((net[1] - self._net[1]) / 1e6, 3)
        self._net = net
        for index, handle in self._gpus:
            with contextlib.suppress(Exception):
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out[f"gpu_{index}_utilization_percentage"] = float(rates.gpu)
                out[f"gpu_{index}_memory_usage_megabytes"] = round(memory.used / 1e6, 1)
                out[f"gpu_{index}_memory_usage_percentage"] = round(
                    100.0 * memory.used / memory.total, 1) if memory.total else 0.0
        return out
