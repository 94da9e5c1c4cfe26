"""Every benchmark of the project, in one process, side by side.

    python -m bench            # full sizes (a few minutes on 2 cores)
    python -m bench --quick    # under 2 minutes on 2 cores (what CI runs)
    python -m bench --drafter runs/<run>/checkpoints/step-000100   # live decoding with a trained drafter

Writes bench/results/<date>-<machine>.json (-2, -3 ... beside an earlier run of the day) and prints a table.
Ratios measured in the same run are the headline figures; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path

import torch

from bench.measure import PeakMemory, matmul_flops
from dflash.io import unused_path
from dflash.tracking import git_commit

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_table(results: dict) -> None:
    from bench import suites  # imported by main after HF_HUB_OFFLINE is set

    print(f"\ndflash benchmarks {results['date']} on {results['machine'].get('gpu') or results['machine']['cpu']}"
          f" ({'quick' if results['quick'] else 'full'}; matmul {results['machine']['matmul_gflops_fp32']} GFLOP/s)")
    print(f"{'figure':40s} {'value':>10s}  goal")
    for key, value in results["headline"].items():
        goal = suites.GOALS.get(key)
        mark = ""
        if goal:
            ok = value >= goal[1] if goal[0] == ">=" else value <= goal[1]
            mark = f"{goal[0]} {goal[1]}  {'ok' if ok else 'MISSED'}"
        print(f"{key:40s} {value:10.4g}  {mark}")
    for name, b in results["benchmarks"].items():
        print(f"  {name}: {b['seconds']} s, peak memory {b['peak_memory_mib']} MiB")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: under 2 minutes on 2 cores")
    parser.add_argument("--drafter", help="a drafter directory for the live-decoding benchmark (default: random)")
    parser.add_argument("--vllm-python", help="python of the vLLM venv (make engines): the real stages also time "
                        "regeneration served by vLLM's CPU build")
    parser.add_argument("--out", type=Path, help="result file (default: bench/results/<date>-<machine>.json)")
    parser.add_argument("--only", nargs="*", help="run only these benchmarks")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from bench import suites  # after HF_HUB_OFFLINE is set: suites imports transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.time()
    # what a result is a measurement of, as the GPU check's report records it (bench/gpu/runner.py)
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "quick": args.quick,
                     "device": str(device), "commit": git_commit(), "command": command, "benchmarks": {}}
    results["machine"]["matmul_gflops_fp32"] = round(matmul_flops(device) / 1e9, 1)
    for name, fn in suites.SUITES.items():
        if args.only and name not in args.only:
            continue
        t = time.time()
        with PeakMemory(device) as mem:
            out = fn(quick=args.quick, device=device, drafter=args.drafter, machine=results["machine"],
                     vllm_python=args.vllm_python)
        out["peak_memory_mib"] = round(mem.mib, 1)
        out["seconds"] = round(time.time() - t, 1)
        results["benchmarks"][name] = out
        print(f"[bench] {name}: done in {out['seconds']} s", file=sys.stderr)
    results["headline"] = suites.headline(results["benchmarks"])
    results["total_seconds"] = round(time.time() - start, 1)
    # a second run of the day goes beside the first (-2, -3 ...): a committed result is never overwritten
    out_path = args.out or unused_path(RESULTS, f"{results['date']}-{_machine_tag(results['machine'])}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwritten to {out_path} ({results['total_seconds']} s)")
    return results


def _machine_tag(m: dict) -> str:
    kind = m.get("gpu") or f"cpu{m['cores']}"
    return "".join(c if c.isalnum() else "-" for c in kind.lower()).strip("-")
