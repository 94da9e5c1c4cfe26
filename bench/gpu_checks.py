"""The checks of bench/gpu_check.sh: each prints one `PASS|FAIL|SKIP <check> <figures or why>` line.

    python -m bench.gpu_checks                      # every check, each in its own process and time limit
    python -m bench.gpu_checks --only live_lossless autocast_loss
    python -m bench.gpu_checks --check flex_train_step --result r.json   # one check, in this process

Writes bench/results/<date>-<machine>-gpu-check.json (and a copy under $OUT when that is set).
On a machine without CUDA the GPU-only checks print SKIP with the reason and the others run small.
Exit status 1 when a check FAILed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]

# flex lengths: pairs a few tokens apart (2048/2000, 1000/1024, 3072/3000) share a padded shape under
# any bucketing coarser than 24 tokens; each pair's second length comes right after its first, so a
# reused graph shows even when the time budget stops the list early
FLEX_LENGTHS = [2048, 2000, 1000, 1024, 3072, 3000, 1500, 4096]
FLEX_ANCHORS = 512
LOSS_REL_TOL = 1e-2  # bf16 autocast against float32: see autocast_loss
GRAD_COS_MIN = 0.99

PARTIAL: Path | None = None
"""Where a check may leave partial results for the case that it runs out of time."""

# check -> time limit in seconds on an H200: flex runs alone, then the rest side by side, 400 s in all;
# with the install and the machine's start that keeps bench/gpu_check.sh under 8 minutes
TIMEOUTS = {"flex_train_step": 230, "gpu_tests": 170, "autocast_loss": 170, "fla_kernels": 170,
            "live_lossless": 170}


def _cuda() -> torch.device | None:
    return torch.device("cuda") if torch.cuda.is_available() else None


def gpu_tests(budget: float) -> dict:
    """The tests marked `gpu` (pytest -m gpu)."""
    if _cuda() is None:
        return {"status": "SKIP", "summary": "needs CUDA (the gpu-marked tests skip themselves on CPU)"}
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    if importlib.util.find_spec("pytest_timeout"):  # a hanging test fails alone, with its traceback
        cmd.append(f"--timeout={int(budget)}")
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = (run.stdout + run.stderr).strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])} \
        if lines else {}
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    ok = run.returncode == 0 and counts.get("passed", 0) > 0
    summary = lines[-1] if lines else f"pytest exited {run.returncode} with no output"
    return {"status": "PASS" if ok else "FAIL", "summary": summary + ("; " + "; ".join(failed) if failed else ""),
            "counts": counts, "tail": lines[-40:]}


def flex_train_step(budget: float) -> dict:
    """Compiled flex training steps at Qwen3-8B drafter size over varying lengths. PASS: no
    recompile-limit fallback (past it flex runs uncompiled, materialising every score), and no more
    flex graphs than distinct padded shapes (dflash.drafter.blocks.flex_padded_shape: 5 for the 8
    lengths); without that bucketing, at most 8 graphs (dynamo's default limit)."""
    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (flex attention trains on CUDA only)"}
    import dflash.drafter.blocks as blocks_module
    from bench.gpu import flex_lengths

    def partial(out):  # what a timeout leaves: the lengths measured so far
        if PARTIAL is not None:
            PARTIAL.write_text(json.dumps({"status": "FAIL", "summary": "partial", **out}, default=str))

    out = flex_lengths(FLEX_LENGTHS, FLEX_ANCHORS, budget, device, on_length=partial)
    done = list(out["lengths"])
    own, graphs = out["compiles"]["flex_compile_count"], out["compiles"]["dynamo_unique_graphs"]
    count = own if own is not None else graphs
    padded = getattr(blocks_module, "flex_padded_shape", None)
    buckets = len({padded(L, FLEX_ANCHORS, FLEX_ANCHORS) for L in done}) if padded else None
    why = []
    if out["recompile_limit_hits"]:
        why.append(f"recompile limit hit: {out['recompile_limit_hits'][0]}")
    if count > (buckets or 8):
        why.append(f"{count} flex graphs compiled for {len(done)} lengths, more than "
                   + (f"their {buckets} padded shapes" if buckets else "dynamo's limit of 8"))
    if len(done) < 3:
        why.append(f"only {len(done)} lengths fit in {budget:.0f} s ({out.get('stopped')})")
    r = [out["lengths"][L] for L in done]
    best = max(r, key=lambda x: x["tflops"]) if r else {}
    mfu = f"mfu {min(x['mfu'] for x in r):.3f}-{max(x['mfu'] for x in r):.3f}" if r and r[0]["mfu"] else "mfu n/a"
    figures = (f"{len(done)}/{len(FLEX_LENGTHS)} lengths {min(done, default=0)}-{max(done, default=0)}, "
               f"{min((x['context_tokens_per_s'] for x in r), default=0):.0f}-"
               f"{max((x['context_tokens_per_s'] for x in r), default=0):.0f} context tok/s, "
               f"{best.get('tflops', 0)} TFLOP/s best, {mfu}, peak "
               f"{max((x['peak_memory_gib'] for x in r), default=0)} GiB, flex graphs {own} (dflash) / "
               f"{graphs} (dynamo) for {buckets} padded shapes")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures,
            "padded_shapes": buckets, **out}


def autocast_loss(budget: float) -> dict:
    """bf16 autocast against float32 on one batch (same weights, same features). bf16 keeps 8 bits of
    mantissa (relative rounding up to 2^-9 per value), but autocast keeps softmax, norms and the
    cross-entropy in float32, matmuls accumulate in float32, and the loss is a mean over thousands of
    label slots whose rounding errors mostly cancel: a correct run moves it by ~1e-5..1e-4 relative
    (measured on CPU). 1e-2 leaves two orders of magnitude for the larger GPU shapes and still catches
    what breaks bf16 training (a reduction or softmax left in bf16, a mask that changes under
    autocast, an overflow), which moves the loss by percents or makes it non-finite. The gradient
    direction must also agree (cosine >= 0.99: a bf16 backward through the wrong mask does not)."""
    from bench.gpu import QWEN3_8B, SMALL, autocast_gap

    device = _cuda() or torch.device("cpu")
    if device.type == "cuda":  # Qwen3-8B drafter size, through flex as training runs on CUDA
        out = autocast_gap(device, QWEN3_8B, length=1024, num_anchors=128, backend="flex")
    else:  # a small stand-in through the SDPA path that training uses on CPU
        out = autocast_gap(device, SMALL, length=512, num_anchors=64, backend="sdpa")
    ok = out["loss_rel_diff"] <= LOSS_REL_TOL and out["grad_cosine"] >= GRAD_COS_MIN
    figures = (f"on {device.type}: loss fp32 {out['loss_float32']:.4f} bf16 {out['loss_bf16_autocast']:.4f} "
               f"(rel diff {out['loss_rel_diff']:.2e}, tol {LOSS_REL_TOL}), grad cosine {out['grad_cosine']:.5f} "
               f"(min {GRAD_COS_MIN}), grad norm ratio {out['grad_norm_ratio']:.4f}")
    return {"status": "PASS" if ok else "FAIL", "summary": figures, **out}


def fla_kernels(budget: float) -> dict:
    """fla against the PyTorch fallback on a tiny hybrid target. PASS: transformers bound fla for the
    Gated DeltaNet layers, and at those layers' outputs fla's bf16 error against the float32
    reference is of the size of the fallback's own bf16 error (mean within 5x, max within 10x): fla
    keeps more intermediates in bf16 than the fallback (which computes in float32 inside), so it
    may round a few times more, while a wrong kernel is off by the size of the output itself."""
    import importlib.util

    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (fla's kernels are Triton, CUDA only; on CPU they "
                                             "would break every forward)"}
    if importlib.util.find_spec("fla") is None:
        return {"status": "FAIL", "summary": "flash-linear-attention is not installed (bench/prepare_wheels.sh, "
                                             "or pip install flash-linear-attention)"}
    from bench.gpu import extraction_kernels

    out = extraction_kernels(device)
    why = []
    if out["kernels"].get("linear_attention") != "fla":
        try:  # why transformers fell back: it swallows the import error
            import fla  # noqa: F401
            reason = "fla imports; transformers did not bind it"
        except Exception as e:  # noqa: BLE001 - reported, not handled
            reason = f"import fla fails: {type(e).__name__}: {e}"
        why.append(f"fla is not bound ({out['kernels']}); {reason}")
    floor = 1e-6 * out["deltanet_rms"]
    ratio = {k: out[f"deltanet_bound_err_{k}"] / max(out[f"deltanet_fallback_err_{k}"], floor) for k in ("mean", "max")}
    if ratio["mean"] > 5 or ratio["max"] > 10:
        why.append(f"fla's error against float32 is {ratio['mean']:.1f}x (mean) / {ratio['max']:.1f}x (max) the "
                   f"fallback's")
    rel = {what: out[f"{what}_max_abs_diff"] / out[f"{what}_rms"] for what in ("deltanet", "features")}
    figures = (f"kernels {','.join(f'{k}={v}' for k, v in sorted(out['kernels'].items()))}; fla vs fallback max diff "
               f"{rel['deltanet']:.3g} of the DeltaNet output rms, {rel['features']:.3g} of the feature rms; error "
               f"vs fp32, fla over fallback: {ratio['mean']:.2f}x mean, {ratio['max']:.2f}x max; fallback "
               f"{out['fallback_over_bound']}x slower")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why + [figures]), "err_ratio": ratio, **out}


def live_lossless(budget: float) -> dict:
    """Live speculative decoding equals plain greedy decoding (float32 and bf16; ties per eval.tie_margin)."""
    from bench.gpu import live_lossless as run
    from dflash.errors import LosslessError

    device = _cuda() or torch.device("cpu")
    try:  # on CPU one short prompt per case: a smoke test of the same code
        out = run(device, prompts=2, new_tokens=64) if device.type == "cuda" else run(device, prompts=1, new_tokens=32)
    except LosslessError as e:
        return {"status": "FAIL", "summary": f"on {device.type}: {e}"}
    runs = out["runs"]
    parts = []
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        rs = [r for r in runs if r["dtype"] == dtype]
        oracle = [r["tau"] for r in rs if r["drafter"] == "oracle"]
        parts.append(f"{dtype} {sum(r['identical'] for r in rs)}/{len(rs)} identical, "
                     f"{sum(not r['identical'] for r in rs)} ties, oracle tau {sum(oracle) / len(oracle):.2f}")
    kernels = next((r["kernels"] for r in runs if r["target"] == "toy"), {})
    ok = all(r["tau"] > 1 for r in runs if r["drafter"] == "oracle")  # accepted drafts were exercised
    return {"status": "PASS" if ok else "FAIL",
            "summary": f"on {device.type}: " + "; ".join(parts) + f"; toy kernels {kernels}"
                       + ("" if ok else "; an oracle drafter had nothing accepted"), **out}


GPU_ONLY = {"flex_train_step", "gpu_tests", "fla_kernels"}
CHECKS = {"flex_train_step": flex_train_step, "gpu_tests": gpu_tests, "autocast_loss": autocast_loss,
          "fla_kernels": fla_kernels, "live_lossless": live_lossless}


def run_one(name: str, budget: float) -> dict:
    t = time.time()
    try:
        out = CHECKS[name](budget)
    except Exception as e:  # noqa: BLE001 - a crash is a FAIL line, not a lost report
        import traceback

        traceback.print_exc()  # into the check's log, whose tail a FAIL line shows
        out = {"status": "FAIL", "summary": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
               "traceback": traceback.format_exc().splitlines()[-30:]}
    out["seconds"] = round(time.time() - t, 1)
    return out


def _spawn(name: str, timeout: float, workdir: Path):
    """`name` in a child process of its own session (so a timeout also ends its compile workers)."""
    log = (workdir / f"{name}.log").open("w")
    cmd = [sys.executable, "-m", "bench.gpu_checks", "--check", name, "--result", str(workdir / f"{name}.json"),
           "--budget", str(max(10.0, timeout - 50))]  # the check's own budget leaves time to start and report
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, time.time() + timeout


def _collect(name: str, proc, deadline: float, workdir: Path, timeout: float) -> dict:
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        partial = workdir / f"{name}.partial.json"
        result = json.loads(partial.read_text()) if partial.exists() else {}
        result.update(status="FAIL", summary=f"timed out after {timeout:.0f} s"
                      + (f"; measured before: {sorted(result.get('lengths', {}))}" if result else ""))
    else:
        path = workdir / f"{name}.json"
        result = json.loads(path.read_text()) if path.exists() else \
            {"status": "FAIL", "summary": f"the check's process exited {proc.returncode} without a result"}
    log = (workdir / f"{name}.log").read_text(errors="replace").splitlines()
    if result["status"] == "FAIL":
        result["log_tail"] = log[-30:]
    return result


def _line(name: str, r: dict) -> str:
    return f"{r['status']} {name} {r['summary']}" + (f" ({r['seconds']} s)" if "seconds" in r else "")


def run_all(names: list[str], budget: float, results_dir: Path) -> dict:
    """Every check in its own process: flex alone first (its timings need the GPU to itself), then
    the others side by side on a GPU machine (their time is mostly compiling), one by one on CPU."""
    from bench.run import _machine_tag, machine

    start = time.time()
    info = machine()
    report = {"date": time.strftime("%Y-%m-%d"), "machine": info, "device": "cuda" if _cuda() else "cpu",
              "checks": {}}
    install = os.environ.get("GPU_CHECK_INSTALL")
    if install:
        status, _, note = install.partition(" ")
        report["checks"]["install"] = {"status": status, "summary": note}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        waves = [[n for n in names if n == "flex_train_step"], [n for n in names if n != "flex_train_step"]]
        if not _cuda():
            waves = [[n] for n in names]
        for wave in waves:
            left = budget - (time.time() - start)
            running = {}
            for name in wave:
                if name in GPU_ONLY and not _cuda():  # SKIP at once, without a process of its own
                    report["checks"][name] = run_one(name, 0)
                    print(_line(name, report["checks"][name]), flush=True)
                    continue
                timeout = min(TIMEOUTS[name], left)
                if timeout < 30:
                    why = f"not run: {left:.0f} s of the {budget:.0f} s budget left"
                    report["checks"][name] = {"status": "FAIL", "summary": why}
                    print(_line(name, report["checks"][name]), flush=True)
                    continue
                running[name] = (*_spawn(name, timeout, workdir), timeout)
            for name, (proc, deadline, timeout) in running.items():
                result = _collect(name, proc, deadline, workdir, timeout)
                report["checks"][name] = result
                print(_line(name, result), flush=True)
                for ln in result.get("log_tail", []) if result["status"] == "FAIL" else []:
                    print(f"    | {ln}", flush=True)
        logs = "\n".join(f"===== {p.stem}\n{p.read_text(errors='replace')}" for p in sorted(workdir.glob("*.log")))
    statuses = [c["status"] for c in report["checks"].values()]
    report["summary"] = {s: statuses.count(s) for s in ("PASS", "FAIL", "SKIP")}
    report["total_seconds"] = round(time.time() - start, 1)
    name = f"{report['date']}-{_machine_tag(info)}-gpu-check.json"
    paths = [results_dir / name] + ([Path(os.environ["OUT"]) / name] if os.environ.get("OUT") else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu-check-logs.txt").write_text(logs)
    s = report["summary"]
    print(f"gpu_check: {s['PASS']} passed, {s['FAIL']} failed, {s['SKIP']} skipped in {report['total_seconds']} s "
          f"on {info.get('gpu') or info['cpu']}; written to {', '.join(map(str, paths))}", flush=True)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all checks (default 400)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON (default bench/results)")
    parser.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)  # one check, in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.check:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        global PARTIAL
        PARTIAL = args.result.with_suffix(".partial.json")
        out = run_one(args.check, args.budget)
        args.result.write_text(json.dumps(out, indent=1, default=str))
        return 0
    report = run_all(args.only or list(CHECKS), args.budget, args.results)
    return 1 if report["summary"]["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
