"""bench/engines/server.py: an engine started as a user starts one, waited for on /health, and stopped with every
process it started; a busy port, an engine that dies and one that never gets healthy are one line each, no hang,
no orphan. The engine here is Python's http.server over a folder holding a file named `health` (GET /health: 200)."""

from __future__ import annotations

import socket
import sys
import time
import urllib.request

import pytest

from bench.engines.server import EngineError, free_port, group_alive, served


def _http_server(root, port: int) -> list[str]:
    (root / "health").write_text("ok")
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)]


def test_a_healthy_engine_is_served_then_stopped_with_its_children(tmp_path):
    port = free_port()
    # the engine starts a child of its own (as vLLM's engine core is): both must be gone afterwards
    cmd = ["bash", "-c", f"sleep 300 & exec {' '.join(_http_server(tmp_path, port))}"]
    with served(cmd, port, tmp_path / "engine.log", timeout=30, grace=5) as (url, proc):
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            assert r.status == 200 and r.read() == b"ok"
        pgid = proc.pid
        assert group_alive(pgid)
    assert proc.poll() is not None
    assert not group_alive(pgid), "a process the engine started outlived it"


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match=rf"port {port} .* is busy"):
            with served(_http_server(tmp_path, port), port, tmp_path / "engine.log", timeout=10):
                pass
    assert not (tmp_path / "engine.log").exists()


def test_an_engine_that_dies_is_reported_with_the_error_line_of_its_log(tmp_path):
    port = free_port()
    script = ("import sys; print('INFO loading the drafter'); "
              "print('ValueError: the drafter has 3 target layers, the model 36'); sys.exit(2)")
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"exited with code 2: ValueError: the drafter has 3 target layers"):
        with served([sys.executable, "-c", script], port, tmp_path / "engine.log", timeout=60):
            pass
    assert time.monotonic() - start < 20, "a dead engine was waited for as if starting"


def test_an_engine_never_healthy_times_out_and_is_stopped(tmp_path):
    port = free_port()
    pid_file = tmp_path / "pid"
    script = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "print('ERROR waiting for a GPU', flush=True); time.sleep(300)")
    with pytest.raises(EngineError, match=r"not healthy after 2 s .*last error: ERROR waiting for a GPU"):
        with served([sys.executable, "-c", script], port, tmp_path / "engine.log", timeout=2, grace=2):
            pass
    assert not group_alive(int(pid_file.read_text())), "the engine that never got healthy was left running"


def test_the_engine_is_stopped_when_the_caller_fails(tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="the client failed"):
        with served(_http_server(tmp_path, port), port, tmp_path / "engine.log", timeout=30, grace=5) as (_, proc):
            raise RuntimeError("the client failed")
    assert proc.poll() is not None and not group_alive(proc.pid)
