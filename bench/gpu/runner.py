"""Runs the checks of bench/gpu/checks.py, each in a process of its own with a time limit, into a report
that survives a killed check (or a killed run).

- A check runs as `python -m bench.gpu.checks --check NAME --result FILE`; it writes FILE when it ends
  and may leave what it measured so far in the file $GPU_CHECK_PARTIAL names (`save_partial`), both
  atomically (dflash.io: temp file, fsync, rename), so a SIGKILL never leaves half a file.
- A check past its time limit is killed with its process group (compile workers included); its partial
  result, if any, goes into its FAIL entry. A result or partial file that does not parse (written by
  something else, or a full disk) is skipped with a note, never fatal.
- The report, bench/results/<date>-<machine>-gpu-check.json (`-2`, `-3` ... for later runs that day: a run never
  overwrites another's report; a copy under $OUT when set), is rewritten after every check: a run killed half-way
  leaves the checks it finished, `complete: false` and the `pending` list.
- Everything in it is written here, at run time: when it started, the machine, the device, the git commit, the
  command, the waves the checks ran in (and per check whether it had the GPU alone), the Triton cache directory
  and the autotuning results it held before and after, and per check the Triton autotunings it ran (counted
  from its log: the runner sets TRITON_PRINT_AUTOTUNING=1). Nothing is added to a report afterwards: notes go in
  docs/results/ or a `<report>.notes.md` next to it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.io import unused_path, write_json

REPO = Path(__file__).resolve().parents[2]
PARTIAL_ENV = "GPU_CHECK_PARTIAL"


def save_partial(out: dict) -> None:
    """What a running check has measured so far, for its report entry should it be killed (atomic)."""
    path = os.environ.get(PARTIAL_ENV)
    if path:
        write_json(Path(path), {"status": "FAIL", "summary": "partial", **out})


def read_result(path: Path) -> tuple[dict | None, str | None]:
    """(the JSON object in `path`, None); (None, None) when there is no file; (None, why) when it does not
    parse or is not an object: the caller notes it and goes on."""
    if not path.exists():
        return None, None
    try:
        obj = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as e:
        return None, f"{path.name} unreadable ({type(e).__name__}: {str(e)[:80]}), skipped"
    if not isinstance(obj, dict) or "status" not in obj:
        return None, f"{path.name} holds no check result ({type(obj).__name__}), skipped"
    return obj, None


# what Triton's autotuner prints for each autotuning it runs (not for a result found in its cache) under
# TRITON_PRINT_AUTOTUNING=1: "Triton autotuning for function NAME,\nwith key as KEY,\nfinished after 1.23s,\n..."
# (before Triton 3.3: "... function NAME finished after 1.23s; ...")
AUTOTUNED = re.compile(r"Triton autotuning for function (\w+),?\s*(?:with key as (.*?),\s*)?finished after ([\d.]+)s",
                       re.S)


def autotunings(log: str) -> dict:
    """The Triton autotunings a check's log shows: how many, their seconds, and each (kernel, key, seconds)."""
    runs = [{"kernel": k, "key": key or None, "seconds": float(t)} for k, key, t in AUTOTUNED.findall(log)]
    return {"count": len(runs), "seconds": round(sum(r["seconds"] for r in runs), 2), "runs": runs}


def triton_cache() -> dict:
    """Triton's cache directory (TRITON_CACHE_DIR, else $TRITON_HOME or ~, then .triton/cache) and how many
    autotuning results it holds: an autotuner with cache_results (fla's, Triton >= 3.4) autotunes a key only when
    the directory has no result for it."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR")
                  or Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache")
    return {"dir": str(folder), "autotune_results": len(list(folder.glob("*/*.autotune.json")))}


def inductor_cache() -> dict:
    """TorchInductor's cache directory (TORCHINDUCTOR_CACHE_DIR, else torch's default under the temporary folder)
    and how many files it holds (compiled graphs, kernels and their autotuning: what a later process reuses)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    return {"dir": str(folder), "files": sum(1 for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0}


def spawn(name: str, budget: float, timeout: float, workdir: Path):
    """Check `name` in a child process of its own session (so a timeout also ends its compile workers)."""
    log = (workdir / f"{_stem(name)}.log").open("w")
    env = {"TRITON_PRINT_AUTOTUNING": "1", **os.environ, PARTIAL_ENV: str(workdir / f"{_stem(name)}.partial.json")}
    cmd = [sys.executable, "-m", "bench.gpu.checks", "--check", name, "--result",
           str(workdir / f"{_stem(name)}.json"), "--budget", str(budget)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()  # the child holds its own descriptor
    return proc, time.time() + timeout


def collect(name: str, proc, deadline: float, timeout: float, workdir: Path) -> dict:
    """The check's result once it ends, or, past `deadline`, a FAIL holding what its partial file kept."""
    stem = _stem(name)
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        partial, note = read_result(workdir / f"{stem}.partial.json")
        result = dict(partial or {})
        kept = f"; measured before: {sorted(result.get('lengths', {}))}" if result.get("lengths") else ""
        kept = kept or ("; its partial result is kept below" if partial else "")
        result.update(status="FAIL", summary=f"timed out after {timeout:.0f} s{kept}" + (f"; {note}" if note else ""))
    else:
        result, note = read_result(workdir / f"{stem}.json")
        if result is None:
            result = {"status": "FAIL", "summary": f"the check's process exited {proc.returncode} without a result"
                                                   + (f" ({note})" if note else "")}
    log = workdir / f"{stem}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    result["triton_autotuning"] = autotunings(text)
    if result["status"] == "FAIL":  # the log's tail, less the autotuner's line per config it tries
        result["log_tail"] = [ln for ln in text.splitlines() if not ln.startswith("Autotuning kernel ")][-30:]
    return result


def line(name: str, r: dict) -> str:
    """The `STATUS check summary (seconds)` line bench/gpu_check.sh prints."""
    return f"{r['status']} {name} {r['summary']}" + (f" ({r['seconds']} s)" if "seconds" in r else "")


def _stem(name: str) -> str:  # a check named module:function (tests) gets a file name without the colon
    return name.replace(":", "-")


class Report:
    """The report file(s), rewritten (atomically) after every check."""

    def __init__(self, names: list[str], results_dir: Path, device: str, command: str, waves: list[list[str]]):
        from bench.run import _machine_tag, machine
        from dflash.tracking import git_commit

        self.start, info = time.time(), machine()
        # the checkout may come without .git (a device machine gets the working tree): GPU_CHECK_COMMIT names it
        self.data = {"date": time.strftime("%Y-%m-%d"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "machine": info, "device": device, "commit": git_commit() or os.environ.get("GPU_CHECK_COMMIT"),
                     "command": command, "waves": waves, "triton_cache": triton_cache(), "checks": {},
                     "pending": list(names), "complete": False}
        self.data["triton_cache"]["autotune_results_before"] = self.data["triton_cache"].pop("autotune_results")
        self.data["inductor_cache"] = inductor_cache()
        self.data["inductor_cache"]["files_before"] = self.data["inductor_cache"].pop("files")
        stem = f"{self.data['date']}-{_machine_tag(info)}-gpu-check"
        name = unused_path(results_dir, stem).name  # another run's report stays as it was
        self.paths = [results_dir / name] + ([Path(os.environ["OUT"]) / name] if os.environ.get("OUT") else [])
        install = os.environ.get("GPU_CHECK_INSTALL")  # bench/gpu_check.sh's own first line
        if install:  # already printed by the script
            status, _, note = install.partition(" ")
            self.data["checks"]["install"] = {"status": status, "summary": note}
        self.save()  # at once: a run killed in its first check still leaves the machine and the plan

    def add(self, name: str, result: dict) -> None:
        self.data["checks"][name] = result
        if name in self.data["pending"]:
            self.data["pending"].remove(name)
        print(line(name, result), flush=True)
        for ln in result.get("log_tail", []) if result["status"] == "FAIL" else []:
            print(f"    | {ln}", flush=True)
        self.save()

    def save(self, complete: bool = False) -> None:
        statuses = [c["status"] for c in self.data["checks"].values()]
        self.data["summary"] = {s: statuses.count(s) for s in ("PASS", "FAIL", "SKIP")}
        self.data["complete"] = complete
        self.data["total_seconds"] = round(time.time() - self.start, 1)
        self.data["triton_cache"]["autotune_results_after"] = triton_cache()["autotune_results"]
        self.data["inductor_cache"]["files_after"] = inductor_cache()["files"]
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, self.data)


def run_all(names: list[str], budget: float, results_dir: Path, plan: dict, command: str | None = None) -> dict:
    """Every check of `names` in its own process, wave by wave (`plan["waves"]`: the checks that time the
    GPU alone first, then the rest side by side), each within min(its time limit, the budget left).
    plan: {"waves": [[name, ...], ...], "timeout": fn(name) -> s, "skip": fn(name) -> result or None}.
    command: the command line the report records (default: this process's)."""
    command = command or shlex.join([Path(sys.executable).name, *sys.argv])
    report = Report(names, results_dir, plan["device"], command, plan["waves"])
    out = os.environ.get("OUT")
    keep = Path(out) / "gpu-check-logs" if out else None  # under $OUT the logs come back even after a kill
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for wave in plan["waves"]:
            running = {}
            for name in wave:
                skipped = plan["skip"](name)
                if skipped is not None:  # SKIP at once, without a process of its own
                    report.add(name, skipped)
                    continue
                left = budget - (time.time() - report.start)
                timeout = min(plan["timeout"](name), left)
                if timeout < min(30.0, plan["timeout"](name)):
                    report.add(name, {"status": "FAIL", "summary": f"not run: {left:.0f} s of the {budget:.0f} s "
                                                                   f"budget left"})
                    continue
                check_budget = timeout - 30 if timeout > 60 else timeout  # 30 s to start (CUDA, imports) and report
                running[name] = (*spawn(name, check_budget, timeout, workdir), timeout)
            for name, (proc, deadline, timeout) in running.items():
                # alone: the GPU to itself, so its tokens/s and MFU are its own (the plan prefers such an MFU)
                report.add(name, {**collect(name, proc, deadline, timeout, workdir), "alone": len(running) == 1})
    report.save(complete=True)
    s, info = report.data["summary"], report.data["machine"]
    print(f"gpu_check: {s['PASS']} passed, {s['FAIL']} failed, {s['SKIP']} skipped in "
          f"{report.data['total_seconds']} s on {info.get('gpu') or info['cpu']}; written to "
          f"{', '.join(map(str, report.paths))}" + (f" (logs in {keep})" if keep else ""), flush=True)
    return report.data
