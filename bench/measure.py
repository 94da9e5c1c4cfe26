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


def time_call(fn) -> float:
    """Wall time of one fn() call, the device's queue drained before and after (CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def median(values) -> float:
    """The middle value (the upper one of an even count): what every timing here reports."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def alternating(fns: dict, rounds: int, per_round: int = 3) -> dict:
    """Median seconds of each fn over `rounds` rounds; in a round each fn runs per_round times in a row and its
    first call after the switch is not counted (a step right after the other model's pays for the allocator's
    page faults: timed one call each in turn, the same DFlash step measured 1.56 s against 2.0 s in a row)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()
            times[k] += [time_call(fn) for _ in range(per_round)]
    return {k: median(v) for k, v in times.items()}


def timed(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall time of fn() over `repeat` runs, after warmup."""
    for _ in range(warmup):
        fn()
    return median(time_call(fn) for _ in range(repeat))


def matmul_call(device: torch.device, n: int = 2048, dtype=torch.float32):
    """(a call multiplying two n x n matrices, its FLOPs): the yardstick of FLOP/s figures."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return (lambda: a @ b), 2 * n**3


def matmul_flops(device: torch.device, n: int = 2048, dtype=torch.float32) -> float:
    call, flops = matmul_call(device, n, dtype)
    return flops / timed(call, repeat=5)


def paired_times(fn, reference, repeat: int, warmup: int = 1) -> tuple[float, float, float]:
    """fn and `reference` called in turn `repeat` times after warmup: (fn's median time, the reference's median
    time, the median of the pairs' reference time / fn time). A shared machine's speed drifts by tens of percent
    within a minute; a ratio of two calls made back to back moves far less than the ratio of two medians taken
    apart."""
    for _ in range(warmup):
        fn(), reference()
    pairs = [(time_call(fn), time_call(reference)) for _ in range(repeat)]
    return median(f for f, _ in pairs), median(r for _, r in pairs), median(r / f for f, r in pairs)


class TensorPeak:
    """Peak bytes of live tensor storages while active, on any device (a TorchDispatchMode that
    sees every aten op's outputs; views share a storage and count once, a storage counts until it
    is freed). Tensors made before entering are counted only once passed to `track`. Buffers a
    kernel allocates internally and frees before returning are not seen.

        with TensorPeak() as mem:
            mem.track(*model.parameters())
            step()
        mem.peak, mem.peak_op   # bytes, the aten op whose outputs made the peak
        mem.largest             # (bytes, shape, op) of the largest storage made: a dense [L, L] shows here
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(torch.utils._pytree.tree_leaves(out), func)
                return out

        self._mode, self._live, self.peak, self.peak_op = _Mode(), {}, 0, None
        self.largest: tuple[int, tuple, str] = (0, (), "")

    def track(self, *tensors) -> None:
        self._see([t for t in tensors if t is not None], "track")

    @property
    def live(self) -> int:
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        return sum(n for _, n in self._live.values())

    def _see(self, outputs, op) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        live = self.live  # drop freed storages first: a new storage may reuse a freed address
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self._live and st.nbytes():
                    self._live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    live += st.nbytes()
                    if st.nbytes() > self.largest[0]:
                        self.largest = (st.nbytes(), tuple(t.shape), str(op))
        if live > self.peak:
            self.peak, self.peak_op = live, str(op)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
