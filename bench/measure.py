"""Measuring helpers shared by the benchmarks: median wall time, peak memory, matmul FLOP/s."""

from __future__ import annotations

import os
import threading
import time

import torch


class PeakMemory:
    """Peak memory during a benchmark, in MiB: on CPU the process's peak resident set (sampled
    every 5 ms; includes what earlier benchmarks left allocated), on CUDA the peak allocation
    above what was allocated at the start."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self._rss()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        else:
            self._stop.set()
            self.thread.join()
            self.mib = max(self.peak, self._rss()) / 2**20
        return False


def timed(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall time of fn() over `repeat` runs, after warmup."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def matmul_flops(device: torch.device, n: int = 2048, dtype=torch.float32) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    t = timed(lambda: a @ b, repeat=5)
    return 2 * n**3 / t
