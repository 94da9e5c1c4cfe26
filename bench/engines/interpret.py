"""Run one of our entry points with transformers bound to the fla kernels, interpreted on the CPU.

    .venv-engines/fla/bin/python -m bench.engines.interpret extract.py debug=tiny target=tiny_qwen3_5

In the fla venv (torch, dflash, triton and flash-linear-attention at the versions of pins.PINNED['fla']): sets
TRITON_INTERPRET=1, checks the pins, applies the interpreter fixes (pins.apply_interpreter_fixes), then runs
the script as `python <script> <overrides>` would, Hydra and all. transformers binds fla when its Qwen3.5
module is imported, so this is the process's backend for every hybrid target it loads.

DFLASH_ENGINES_BREAK=backend: a deliberate break for the fla check to catch. The kernel report says the PyTorch
fallback ran while fla did, as if provenance did not see which kernels transformers bound.
"""

from __future__ import annotations

import os
import runpy
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported

from bench.engines import REPO, pins  # noqa: E402  (after the environment it reads)


def break_backend() -> None:
    import dflash.target.loading as loading

    real = loading.kernel_report

    def reported_as_fallback(model, layer_types):
        report = real(model, layer_types)
        return {k: "torch_fallback" if v == "fla" else v for k, v in report.items()}

    loading.kernel_report = reported_as_fallback


def main() -> None:
    pins.apply_interpreter_fixes()  # checks the fla venv's pins first
    if os.environ.get("DFLASH_ENGINES_BREAK") == "backend":
        break_backend()
    script, *overrides = sys.argv[1:]
    sys.argv = [script, *overrides]
    runpy.run_path(str(REPO / script), run_name="__main__")


if __name__ == "__main__":
    main()
