"""dflash.dist: long waits through the c10d store (processes stood in for by threads sharing one store), and
two gloo processes in which a plain barrier times out where `wait_long` does not."""

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


def together(world: int, body, **timing) -> list:
    """body(dist) on `world` threads, one Dist each on one shared store; what each returned or raised."""
    store, out = HashStore(), [None] * world

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


def test_collective_timeout_is_validated_and_reaches_the_accelerator():
    from dflash.config import TrainConfig
    from dflash.train.accel import make_accelerator
    from tests.conftest import compose

    with pytest.raises(ConfigError, match=r"train.collective_timeout_minutes=0 must be > 0"):
        TrainConfig(collective_timeout_minutes=0)
    # what accelerate hands to init_process_group: it drops a value equal to its own default of 10 min
    # (torch would then take 30 for gloo), so 10 must still get through
    for minutes in (0.05, 10, 30):
        acc = make_accelerator(compose("train", ["debug=tiny", f"train.collective_timeout_minutes={minutes}"]))
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
    """Two gloo processes with a 3 s collective timeout, rank 0 6 s late: the plain barrier times out on rank 1
    (so the timeout reaches the group, and this is what the long waits are for); wait_long completes."""
    (tmp_path / "late.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(tmp_path / "late.py"),
           mode, str(tmp_path / "out")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "TIMEOUT_MINUTES": "0.05",
           "LATE_S": "6", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    one = (tmp_path / "out-1.txt").read_text()
    if mode == "long":
        assert one.startswith("passed after") and int(one.split()[2]) >= 5, one  # it did wait for rank 0
        assert (tmp_path / "out-0.txt").read_text().startswith("passed")
    else:
        assert one.startswith("failed:") and "imed out" in one, one
