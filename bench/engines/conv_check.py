"""The conv check: DFlash 2's Triton convolution (dflash/drafter/conv_kernel.py) equals the torch path, forward and
backward, run by Triton's interpreter in the fla venv (bench/engines/conv_probe.py gives the figures).

    python -m bench.engines.conv_check --fla-python .venv-engines/fla/bin/python [--break conv]

PASS when, for every shape of conv_probe.SHAPES, the kernel's output and gradients meet bench.dflash2_conv's rule
(within FLOAT32_TOL of the torch path's in float32; in bfloat16 no further from the float32 torch path than the
bfloat16 torch path is, or one bfloat16 rounding); and a tiny DFlash 2 drafter's training step through the kernel
(chosen by train.conv_kernel=auto, as training chooses it) has the torch step's loss and gradients. On a GPU the same
comparison runs as a test (tests/drafter/test_conv_kernel.py, in the GPU check's gpu_tests).
--break conv: the kernel is handed the whole query row as one block; the check must FAIL.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench.dflash2_conv import BF16_ROUNDING, FLOAT32_TOL
from bench.engines import REPO, run

STEP_LOSS_TOL, STEP_GRAD_TOL = 1e-5, 1e-4
"""The drafter step: loss and the largest gradient difference over that gradient's largest entry (the convolution's
rounding differences pass through attention, the MLP and the selector)."""


def check(fla_python: str, work: Path, broken: str | None = None) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = work / "probe.json"
    run([fla_python, "-m", "bench.engines.conv_probe", str(out), *(["--break"] if broken == "conv" else [])],
        work / "probe.log", env={"HF_HUB_OFFLINE": "1"})
    result = json.loads(out.read_text())
    result["break"] = broken
    s = result["step"]  # each shape's "ok" is bench.dflash2_conv.compare's rule
    s["ok"] = (s["conv_kernel"] == "triton" and s["same_grads"] and s["loss_rel_diff"] <= STEP_LOSS_TOL
               and s["grad_rel_diff"] <= STEP_GRAD_TOL)
    result["ok"] = all(r["ok"] for r in result["ops"].values()) and s["ok"]
    return result


def verdict(result: dict) -> str:
    lines = [f"conv check (DFlash 2's Triton convolution against the torch path; triton {result['triton']}, torch "
             f"{result['torch']}, Triton's interpreter):"]
    for label, row in result["ops"].items():
        if "kernel_vs_torch" in row:
            figures = f"max diff {max(row['kernel_vs_torch'].values()):.1e} of the largest value (tol {FLOAT32_TOL:.0e})"
        else:
            k, t = row["kernel_vs_float32"], row["torch_vs_float32"]
            figures = (f"from float32: kernel {max(k.values()):.1e}, torch {max(t.values()):.1e} "
                       f"(kernel at most torch's or {BF16_ROUNDING:.1e}, output by output)")
        lines.append(f"  {label}: {'equal' if row['ok'] else 'NOT EQUAL'} forward and backward, {figures}")
    s = result["step"]
    lines.append(f"  DFlash 2 drafter step with train.conv_kernel=auto -> {s['conv_kernel']}: loss {s['loss_kernel']:.6f} "
                 f"(torch {s['loss_torch']:.6f}), {s['grads']} gradients within {s['grad_rel_diff']:.1e} (worst "
                 f"{s['worst_grad']}; tol {STEP_GRAD_TOL:.0e}): {'equal' if s['ok'] else 'NOT EQUAL'}")
    lines.append(f"conv check: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fla-python", required=True, help="python of the fla venv (torch and triton)")
    parser.add_argument("--work", default=str(REPO / "build" / "engines" / "conv"))
    parser.add_argument("--break", dest="broken", choices=["conv"], help="a deliberate break the check must catch")
    args = parser.parse_args()
    result = check(args.fla_python, Path(args.work), args.broken)
    print(verdict(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
