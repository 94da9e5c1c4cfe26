"""The little of distributed state that data preparation needs: rank, world size, and two ways of waiting.

`barrier` is the process group's collective: it gives up after `train.collective_timeout_minutes`, which suits
waits that are short by construction (around a checkpoint write). `wait_long` is for waits after per-process
work of unbounded length (completions, extraction, the in-run evaluation on the main process): hours, where
the processes' shares, disks or resumed state differ.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash.errors import DistributedError

log = logging.getLogger(__name__)

_KEYS = "dflash"  # every key this module puts in the store starts so
_REWARN_S = 600.0  # while the heartbeat keeps failing, a warning this often (one per failure would flood the log)


@dataclass
class Dist:
    """This process's place among the processes of a launch, and how they wait for one another.

    `wait_long` waits through the c10d store of the process group (the TCPStore of the launcher's rendezvous),
    not through a collective and not through marker files. Store keys are set and read by plain requests, so
    no collective is pending while a process waits (NCCL's watchdog has nothing to time out) and each wait has
    its own limits; the keys live as long as the launch, so a crashed earlier launch leaves no stale markers
    (as files in the run folder would), and no shared filesystem, or its caching of file metadata, is needed.

    A waiting process must not wait for a process that is gone. Each process, from a background thread, bumps
    a heartbeat counter in the store every `beat_s`, and at exit (atexit: a normal end, an error that ends it,
    sys.exit) records that it ended. A waiting process stops with a DistributedError naming the processes it
    waits for when one of them ended, was not heard from for `silence_s` (killed outright: a multi-node run's
    launcher does not stop the other nodes), or has not arrived within `limit_s`.

    Only the waiting processes decide that one is dead; the heartbeat never gives up on its own process. A bump
    that fails (a store request that timed out, a connection reset) is retried sooner, backing off from beat_s/8
    to beat_s, for as long as it takes: stopping would leave a healthy process silent, and after `silence_s`
    its peers would stop the run. It warns once when the bumps start failing (and every 10 min while they go
    on) and says when they get through again; `beat_failures` and `beat_streak` count the failures.
    """

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)
    """The collective barrier (subject to the process group's timeout)."""
    store: object | None = None
    """The c10d store of the process group; None with one process (or a test's stand-in, whose `wait_long` is
    `barrier`)."""
    limit_s: float = 7 * 24 * 3600.0
    """Longest wait in `wait_long` before giving up, naming the processes that did not arrive."""
    silence_s: float = 30 * 60.0
    """A process whose heartbeat has not moved for this long while others wait for it is taken for dead."""
    beat_s: float = 10.0
    """Seconds between heartbeats (the waiting processes look for ended or silent ones every 3 of them)."""
    beat_failures: int = field(default=0, init=False)
    """Heartbeat bumps that failed, in all."""
    beat_streak: int = field(default=0, init=False)
    """Heartbeat bumps that failed since the last one that got through."""
    _warned: float = field(default=0.0, init=False, repr=False)  # when the current streak last warned
    _entered: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _beating: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.store is not None and self.world > 1:
            self._beating = threading.Thread(target=self._beat, name=f"dflash-heartbeat-{self.rank}", daemon=True)
            self._beating.start()
            atexit.register(self.leave)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wait_long(self, name: str) -> None:
        """Wait, however long, until every process has called `wait_long(name)` as often as this one has: each
        call is one generation of a reusable barrier, so every process must make the same sequence of calls.
        Raises DistributedError when a process it waits for has ended, fallen silent or not arrived in time."""
        if self.world == 1:
            return
        if self.store is None:
            self.barrier()
            return
        generation = self._entered[name] = self._entered.get(name, -1) + 1
        key = f"{_KEYS}/wait/{name}/{generation}"
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.add(f"{key}/arrived", 1)
        start = last_scan = last_log = time.monotonic()
        heard = {r: (-1, start) for r in range(self.world)}  # heartbeat value, when it last moved
        delay = 0.02
        while self.store.add(f"{key}/arrived", 0) < self.world:
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
            now = time.monotonic()
            if now - last_scan < 3 * self.beat_s:
                continue
            last_scan = now
            missing = [r for r in range(self.world) if not self.store.check([f"{key}/{r}"])]
            ended = [r for r in missing if self.store.check([f"{_KEYS}/ended/{r}"])]
            for r in missing:
                beat = self.store.add(f"{_KEYS}/alive/{r}", 0)
                if beat != heard[r][0]:
                    heard[r] = (beat, now)
            silent = [r for r in missing if now - heard[r][1] > self.silence_s]
            where = f"process {self.rank} waited at '{name}' for processes {missing}"
            if ended:
                raise DistributedError(f"{where}, but {ended} ended without arriving: their logs say why (the "
                                       f"first error is the cause). Fix it and start again: caches and "
                                       f"completions resume where they stopped")
            if silent:
                raise DistributedError(f"{where}, but {silent} have not been heard from for "
                                       f"{self.silence_s / 60:.0f} min: they were killed (their launcher's log, or "
                                       f"the system's, says why: out of memory?). Start again: caches and "
                                       f"completions resume where they stopped")
            if now - start > self.limit_s:
                raise DistributedError(f"{where} for {self.limit_s / 3600:.1f} h; they are alive but never "
                                       f"arrived (a hang, or processes running different code): their logs say "
                                       f"where they are")
            if now - last_log >= 600:
                last_log = now
                log.info("%s (%.0f min so far)", where, (now - start) / 60)

    def leave(self) -> None:
        """Record that this process ends (at exit): any process still waiting for it stops. Stops the heartbeat
        first, before the interpreter tears down (a thread caught inside a store request would abort it)."""
        self.close()
        if self.store is not None and self.world > 1:
            try:
                self.store.set(f"{_KEYS}/ended/{self.rank}", "1")
            except Exception as e:  # the store ended with the launch: nobody is left waiting
                log.debug("could not record that process %d ends: %r", self.rank, e)

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()
        if self._beating is not None and self._beating is not threading.current_thread():
            self._beating.join(timeout=10)

    def _beat(self) -> None:
        """The heartbeat thread: bump, wait, until `close`. Waiting on `_stop` lets `close` end it at once, even
        in a retry's backoff. When the store has gone for good (the launch ended) it retries, quietly, until the
        atexit `leave` stops it; it is a daemon thread, so a request caught in a dead store cannot hold up exit."""
        key = f"{_KEYS}/alive/{self.rank}"
        while not self._stop.is_set():
            self._stop.wait(self._bump(key))

    def _bump(self, key: str) -> float:
        """Bump the heartbeat counter once; the seconds to wait before the next bump."""
        try:
            self.store.add(key, 1)
        except Exception as e:  # any failure of the store: the thread must outlive it (see the class docstring)
            return self._failed(e)
        if self.beat_streak:
            log.info("process %d's heartbeat reached the store again after %d failures", self.rank, self.beat_streak)
            self.beat_streak = 0
        return self.beat_s

    def _failed(self, error: Exception) -> float:
        """Count and report a failed bump; the backoff before the retry: beat_s/8, doubling up to beat_s."""
        self.beat_failures += 1
        self.beat_streak += 1
        now = time.monotonic()
        if self.beat_streak == 1 or now - self._warned >= _REWARN_S:
            self._warned = now
            log.warning("process %d could not send its heartbeat to the store (%r; %d failures in a row, %d in "
                        "all); retrying. Its peers take it for killed after %.0f min without one. At the end of a "
                        "launch this is expected: the store ends with it", self.rank, error, self.beat_streak,
                        self.beat_failures, self.silence_s / 60)
        else:
            log.debug("process %d: heartbeat failed again (%r, %d in a row)", self.rank, error, self.beat_streak)
        return self.beat_s / 8 * 2 ** min(self.beat_streak - 1, 3)  # capped exponent: no float overflow


_current: Dist | None = None


def current(timeout_minutes: float | None = None) -> Dist:
    """This process's place in an `accelerate launch` (or a single process): the same object on every call,
    so that `wait_long`'s generations count across callers. `timeout_minutes` is the process group's collective
    timeout (train.collective_timeout_minutes), applied where this call starts the group (extract.py,
    evaluate.py; in train.py the Accelerator has started it)."""
    global _current
    if _current is not None:
        return _current
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    kwargs = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    # cpu=True on machines without CUDA: otherwise accelerate does not start the gloo group
    # and every process of an `accelerate launch` believes it is alone
    state = PartialState(cpu=not torch.cuda.is_available(), **kwargs)
    if state.num_processes == 1:
        _current = Dist()
    else:
        from torch.distributed.distributed_c10d import _get_default_store  # the group's store; no public getter

        _current = Dist(state.process_index, state.num_processes, state.wait_for_everyone, _get_default_store())
    return _current


def finish() -> None:
    """At the normal end of a launch's process: wait for the other processes (`wait_long`: their shares of the
    work may end hours apart), stop the heartbeat and destroy every process group, as PyTorch asks of a program
    that started one. Left to the interpreter's exit, the groups' threads can abort a process that has done
    its work (gloo, seen as "terminate called without an active exception"), and the launch then fails."""
    import torch.distributed as td

    if not (td.is_available() and td.is_initialized()):
        return
    if _current is not None:
        _current.wait_long("finish")
        _current.leave()
    td.destroy_process_group()
