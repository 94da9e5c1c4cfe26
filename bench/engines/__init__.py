"""`make engines`: the real engines in the loop, each in a venv of its own (never the main one).

- vllm_check: vLLM's CPU build serves drafters train.py trained, equal to our live evaluation
  (vllm_serve.py is what runs in the vLLM venv).
- vllm_features_check: extract.py with features.source=vllm (vLLM's extract_hidden_states, run by the library's
  dflash/data/vllm_runtime/vllm_extract.py with the CPU connector shim beside it) equals transformers' features,
  recorded and kept apart.
- fla_check: extraction through the fla kernels (Triton's interpreter, with the fixes of triton_fixes.py),
  recorded as such, equal to the PyTorch fallback's within tolerance, and never mixed with it.
- conv_check: DFlash 2's Triton convolution (dflash/drafter/conv_kernel.py) equals the torch path forward and
  backward, and in a drafter's training step, under Triton's interpreter in the fla venv (conv_probe.py runs there).
- pins: the engine versions these checks were verified with (the vLLM venv's: the library's vllm_pins.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compose_job(config_name: str, overrides: list[str]):
    """conf/<config_name>.yaml with overrides, as its entry point turns it into a JobConfig."""
    from hydra import compose, initialize_config_dir

    from dflash.cli import to_job
    from dflash.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_job(compose(config_name, overrides))


def run(cmd: list[str], log: Path, env: dict | None = None, check: bool = True) -> int:
    """cmd in the repository root, its output to `log`; a failure stops the check, naming the log."""
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if check and proc.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}); see {log}")
    return proc.returncode


def vllm_serve_command(vllm_python, model: str, port, dtype: str, max_model_len: int, max_num_seqs: int) -> list:
    """`vllm serve model` as a user types it, run in the vLLM venv through vllm_cli.py (the CPU wheel's `vllm` script
    cannot start): eager (nothing compiled), seeded, 15% of the memory reserved (the CPU build's share),
    `max_num_seqs` requests at once. `port` may be a placeholder the caller fills in."""
    return [vllm_python, REPO / "bench" / "engines" / "vllm_cli.py", "serve", model, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
            "--gpu-memory-utilization", "0.15", "--max-num-seqs", str(max_num_seqs)]
