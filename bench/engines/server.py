"""A serving engine as a user runs one: a command that listens on a port, waited for on its health endpoint, and
stopped, with every process it started, when the caller is done or fails.

    with served(["vllm", "serve", model, "--port", str(port)], port, log) as url:
        ...  # requests to url; an EngineError says in one line why the engine is not there

`served` refuses a busy port before starting anything, polls GET /health until it answers 200 (an engine that
exits first is reported with the error line of its log: a drafter the engine refuses ends so), gives up after
`timeout` seconds, and on the way out sends SIGTERM to the engine's process group (it starts in a session of its
own, so vLLM's engine-core and worker processes are in it), then SIGKILL to what is left after `grace` seconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HOST = "127.0.0.1"


class EngineError(RuntimeError):
    """The engine did not start, died, or refused what it was given: one line, for people."""


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the OS picks it; another process may still take it before the engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_busy(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# the lines of a log that say why a process stopped: an exception, vLLM's "ERROR" records, or a shell's complaint
_REASON = re.compile(r"(^\w*(Error|Exception)\b.*|\bERROR\b.*|: not found$|No such file.*)")


def last_error(log: Path, default: str = "no error line in its log") -> str:
    """The last line of `log` that says what went wrong, shortened to one line."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return default
    found = [m.group(0).strip() for line in lines if (m := _REASON.search(line.strip()))]
    # vLLM's EngineCore failures end in "RuntimeError: Engine core initialization failed. See root cause above":
    # the root cause is the exception line before it
    found = [f for f in found if "See root cause above" not in f and "Traceback" not in f] or found
    return (found[-1] if found else default)[:400]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process group of `proc`, SIGKILL to what is left after `grace` seconds; waits for `proc`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(proc.pid):
                return
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (a zombie is not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for entry in Path("/proc").iterdir():  # killpg(0) also succeeds for zombies: look at their state
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def check_alive(proc: subprocess.Popen, log: Path, what: str = "the engine") -> None:
    """Raise EngineError when `proc` has exited."""
    if proc.poll() is not None:
        raise EngineError(f"{what} exited with code {proc.returncode}: {last_error(log)} (log: {log})")


@contextlib.contextmanager
def served(cmd: list[str], port: int, log: Path, timeout: float = 300.0, env: dict | None = None,
           grace: float = 20.0, host: str = HOST) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `cmd` (a server for `port`) until the block ends; yields (its base URL, the process)."""
    if port_busy(port, host):
        raise EngineError(f"port {port} on {host} is busy: another process listens there; choose another port "
                          f"(or none: a free one is picked)")
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{host}:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    try:
        start = time.monotonic()
        while not healthy(url):
            check_alive(proc, log)
            if time.monotonic() - start > timeout:
                raise EngineError(f"the engine was not healthy after {timeout:.0f} s ({url}/health); "
                                  f"last error: {last_error(log, 'none')} (log: {log})")
            time.sleep(0.5)
        yield url, proc
    finally:
        stop(proc, grace)
