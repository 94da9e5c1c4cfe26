"""dflash.dist: long waits through the c10d store (processes stood in for by threads sharing one store), and
two gloo processes in which a plain barrier times out where `wait_long` does not."""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed import HashStore

from dflash.dist import Dist
from dflash.errors import ConfigError, DistributedError
from tests.conftest import REPO

FAST = {"beat_s": 0.05, "silence_s": 30.0, "limit_s": 30.0}


def together(world: int, body, store=None, **timing) -> list:
    """body(dist) on `world` threads, one Dist each on one shared store (a fresh HashStore unless given); what
    each returned or raised."""
    store, out = store or HashStore(), [None] * world

    def run(rank):
        dist = Dist(rank, world, store=store, **{**FAST, **timing})
        try:
            out[rank] = body(dist)
        except Exception as e:
            out[rank] = e
        finally:
            dist.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_one_process_and_stand_ins_do_not_wait():
    calls = []
    Dist().wait_long("x")
    Dist(rank=1, world=2, barrier=lambda: calls.append(1)).wait_long("x")  # no store: the barrier it was given
    assert calls == [1]


def test_wait_long_waits_for_the_slowest_and_is_reusable():
    """Three generations of one name; in each a different process is late. Nobody leaves a generation before
    the late one arrives, and an early process never passes a later generation on an earlier one's count."""
    log = []

    def body(dist):
        for generation in range(3):
            if dist.rank == generation % 2:
                time.sleep(0.3)
            log.append(("in", generation, dist.rank))
            dist.wait_long("work")
            log.append(("out", generation, dist.rank))
        return "done"

    assert together(2, body) == ["done", "done"]
    for generation in range(3):
        last_in = max(i for i, e in enumerate(log) if e[:2] == ("in", generation))
        first_out = min(i for i, e in enumerate(log) if e[:2] == ("out", generation))
        assert last_in < first_out, log


def test_a_process_that_ends_without_arriving_is_named():
    """Process 1 fails and exits (atexit runs `leave`): the others stop waiting within a few heartbeats."""
    def body(dist):
        if dist.rank == 1:
            dist.leave()
            return "failed"
        dist.wait_long("extract")

    t0 = time.monotonic()
    out = together(3, body)
    for rank in (0, 2):
        assert isinstance(out[rank], DistributedError), out
        assert f"process {rank} waited at 'extract' for processes [1], but [1] ended without arriving" in str(out[rank])
    assert time.monotonic() - t0 < 10


def test_a_silent_process_is_named():
    """Process 1 never starts (no heartbeat, no arrival): the others stop after silence_s, naming it."""
    def body(dist):
        if dist.rank == 1:
            dist.close()  # dead from the start
            return "dead"
        dist.wait_long("eval")

    t0 = time.monotonic()
    out = together(2, body, silence_s=0.5)
    assert isinstance(out[0], DistributedError) and "for processes [1], but [1] have not been heard" in str(out[0])
    assert time.monotonic() - t0 < 10


def test_an_alive_process_that_never_arrives_is_named_at_the_limit():
    def body(dist):
        if dist.rank == 1:
            time.sleep(1.5)  # alive (beating), never arrives
            return "elsewhere"
        dist.wait_long("eval")

    out = together(2, body, limit_s=0.5)
    assert isinstance(out[0], DistributedError)
    assert "for processes [1] for 0.0 h; they are alive but never arrived" in str(out[0])


class FlakyBeat:
    """A store on which process `rank`'s heartbeat bumps fail `failures` times (None: always), as a TCPStore
    request that timed out does; every other request goes through."""

    def __init__(self, rank: int, failures: int | None):
        self.store, self.key, self.left = HashStore(), f"dflash/alive/{rank}", failures

    def add(self, key: str, n: int) -> int:
        if key == self.key and n != 0 and self.left != 0:  # a bump; reading the counter (n=0) still works
            self.left = None if self.left is None else self.left - 1
            raise RuntimeError("Socket Timeout")
        return self.store.add(key, n)

    def __getattr__(self, name):
        return getattr(self.store, name)


def poll(condition, timeout: float = 3.0) -> bool:
    """Whether `condition()` came true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def heartbeat_records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dflash.dist" and r.levelno == level]


def test_a_heartbeat_that_fails_for_a_while_recovers_and_the_run_goes_on(caplog):
    """Process 1's first 5 heartbeats fail (a store hiccup), then the store answers again. Process 1 keeps
    beating, so process 0, waiting for it for 4x silence_s, goes on when it arrives instead of taking it for
    killed. (Before, the heartbeat thread ended at the first failure and the run stopped.)"""
    caplog.set_level(logging.INFO, logger="dflash.dist")
    store, silence = FlakyBeat(rank=1, failures=5), 0.25

    def body(dist):
        if dist.rank == 1:
            time.sleep(4 * silence)  # busy elsewhere for longer than silence_s: only its heartbeat speaks for it
        dist.wait_long("eval")
        return dist

    zero, one = together(2, body, store=store, silence_s=silence)
    assert isinstance(zero, Dist), zero  # not a DistributedError: process 0 went on
    assert (one.beat_failures, one.beat_streak) == (5, 0)
    beat = store.add("dflash/alive/1", 0)
    assert beat > 5, beat  # it beat on after the failures, through the wait
    warned = heartbeat_records(caplog, logging.WARNING)
    assert len(warned) == 1 and "process 1 could not send its heartbeat" in warned[0], warned
    assert any("process 1's heartbeat reached the store again after 5 failures" in m
               for m in heartbeat_records(caplog, logging.INFO)), caplog.text


def test_a_heartbeat_that_never_recovers_keeps_trying_and_the_peers_name_it(caplog):
    """Process 1's heartbeats always fail: its heartbeat thread keeps trying (it does not decide it is dead,
    and warns once, not per failure), and process 0 stops after silence_s naming it."""
    store, gave_up = FlakyBeat(rank=1, failures=None), threading.Event()

    def body(dist):
        if dist.rank == 0:
            try:
                dist.wait_long("eval")
            finally:
                gave_up.set()
        assert poll(gave_up.is_set), "process 0 never gave up waiting"
        failures = dist.beat_failures
        assert poll(lambda: dist.beat_failures > failures), "the heartbeat stopped retrying"
        return dist._beating.is_alive(), dist.beat_failures

    zero, (alive, failures) = together(2, body, store=store, silence_s=0.25)
    assert isinstance(zero, DistributedError) and "for processes [1], but [1] have not been heard" in str(zero)
    assert alive and failures > 3
    warned = heartbeat_records(caplog, logging.WARNING)
    assert len(warned) == 1 and "process 1 could not send its heartbeat" in warned[0], warned


def test_close_stops_a_heartbeat_waiting_to_retry():
    """With beat_s=20 the first retry is 2.5 s after the failure; close() must not wait for it."""
    dist = Dist(0, 2, store=FlakyBeat(rank=0, failures=None), **{**FAST, "beat_s": 20.0})
    assert poll(lambda: dist.beat_failures == 1)
    t0 = time.monotonic()
    dist.close()
    assert time.monotonic() - t0 < 1.0 and not dist._beating.is_alive()
    assert dist.beat_failures == 1  # it was still waiting to retry


def test_collective_timeout_is_validated_and_reaches_the_accelerator():
    from dflash.config import TrainConfig
    from dflash.train.accel import make_accelerator
    from tests.conftest import compose

    with pytest.raises(ConfigError, match=r"train.collective_timeout_minutes=0 must be > 0"):
        TrainConfig(collective_timeout_minutes=0)
    # what accelerate hands to init_process_group: it drops a value equal to its own default of 10 min
    # (torch would then take 30 for gloo), so 10 must still get through
    for minutes in (0.05, 10, 30):
        acc = make_accelerator(compose("train", ["debug=tiny", f"train.collective_timeout_minutes={minutes}"]).train)
        timeout = acc.init_handler.to_kwargs()["timeout"].total_seconds()
        assert abs(timeout - 60 * minutes) < 1e-3, (minutes, timeout)


SCRIPT = """
import os, sys, time
from dflash.dist import current

mode, out = sys.argv[1], sys.argv[2]
dist = current(timeout_minutes=float(os.environ["TIMEOUT_MINUTES"]))
late = float(os.environ["LATE_S"])
t0 = time.monotonic()
if dist.rank == 0:
    time.sleep(late)  # rank 0's share takes longer than the collective timeout
try:
    dist.wait_long("work") if mode == "long" else dist.barrier()
    result = f"passed after {time.monotonic() - t0:.0f} s"
except Exception as e:
    result = f"failed: {type(e).__name__}: {e}"
with open(f"{out}-{dist.rank}.txt", "w") as f:
    f.write(result)
os._exit(0)  # a group whose barrier timed out cannot be shut down cleanly
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["long", "plain"])
def test_a_process_late_past_the_collective_timeout(tmp_path, mode):
    """Two gloo processes with a 3 s collective timeout, rank 0 4.5 s late: the plain barrier times out on rank 1
    (so the timeout reaches the group, and this is what the long waits are for); wait_long completes."""
    (tmp_path / "late.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(tmp_path / "late.py"),
           mode, str(tmp_path / "out")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "TIMEOUT_MINUTES": "0.05",
           "LATE_S": "4.5", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    one = (tmp_path / "out-1.txt").read_text()
    if mode == "long":
        assert one.startswith("passed after") and int(one.split()[2]) >= 4, one  # it did wait for rank 0
        assert (tmp_path / "out-0.txt").read_text().startswith("passed")
    else:
        assert one.startswith("failed:") and "imed out" in one, one
