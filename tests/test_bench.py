"""The benchmarks still run against the library (a smoke test: quick sizes, the cheap suites only)."""

import torch

from bench import suites


def test_cheap_benchmarks_run_and_report_their_figures():
    out = suites.bytes_per_token(quick=True)
    assert 0.98 <= out["bf16_over_bound"] <= 1.02 and out["fp8_over_bf16"] < 0.52
    out = suites.eval_blocks(quick=True, device=torch.device("cpu"))
    assert out["blocks_per_s"] > 0


def test_gpu_suites_are_registered_and_skip_on_cpu():
    """`python -m bench` runs the GPU suites of bench/gpu.py wherever it runs: on CPU they say why not."""
    for name in ("gpu_train_step", "gpu_extraction_kernels"):
        assert suites.SUITES[name](quick=True, device=torch.device("cpu")) == {"skipped": "needs CUDA"}
