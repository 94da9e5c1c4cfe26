"""DFlash 2's Triton convolution (dflash/drafter/conv_kernel.py) against the torch path: one comparison rule, used
by the engines' conv check (Triton's interpreter, bench/engines/conv_probe.py), the GPU test
(tests/drafter/test_conv_kernel.py) and the GPU check (`conv_on_gpu`, before qwen3_6_dflash2_step trains with it).

The rule: the forward and the three gradients (input, static taps, dynamic taps), the taps a strided view of the
projection as GroupedDynamicConv.prepare passes them, each compared by its largest difference over its largest
value. In float32 within FLOAT32_TOL of the torch path; in bfloat16 no further from the float32 torch path than the
bfloat16 torch path is, or one bfloat16 rounding (BF16_ROUNDING: the kernel sums in float32 and rounds once).
"""

from __future__ import annotations

import torch

FLOAT32_TOL = 1e-5
"""Largest kernel-vs-torch difference over the largest value, float32: sums in another order (2^-23 a rounding)."""
BF16_ROUNDING = 2.0 ** -8
"""One bfloat16 rounding, relative."""
OUTPUTS = ("out", "grad_input", "grad_base", "grad_taps")
QWEN3_6_27B = {"batch": 1, "queries": 4096, "hidden": 5120, "kernel_size": 2, "group_size": 16, "block_len": 8}
"""The published 27B DFlash 2 drafter's convolution in a training step: 512 blocks of 8, hidden 5120."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def inputs(shape: dict, dtype: torch.dtype, device, seed: int = 0) -> tuple:
    """(z, base, projection [b, q, 2, k, G], output gradient) for `shape`, random, on `device`."""
    g = torch.Generator().manual_seed(seed)
    b, q, H, k = shape["batch"], shape["queries"], shape["hidden"], shape["kernel_size"]
    z = torch.randn(b, q, H, generator=g).to(dtype)
    base = torch.randn(k, H, generator=g)
    proj = torch.randn(b, q, 2, k, H // shape["group_size"], generator=g).to(dtype)
    grad = torch.randn(b, q, H, generator=g).to(dtype)
    return tuple(t.to(device) for t in (z, base, proj, grad))


def run(conv, z, base, proj, grad, group_size: int, block_len: int) -> tuple:
    """out and the gradients of (z, base, the projection) through `conv`, taps sliced from the projection."""
    z, base, proj = (t.detach().requires_grad_(True) for t in (z, base, proj))
    out = conv(z, base, proj[..., 0, :, :], group_size, block_len)
    return (out, *torch.autograd.grad(out, (z, base, proj), grad.to(out.dtype)))


def compare(kernel, reference, shape: dict, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """`kernel` against `reference` (the torch path) on random inputs of `shape` in `dtype`, by the rule above;
    "ok" says whether it holds."""
    z, base, proj, grad = inputs(shape, dtype, device, seed)
    gs, L = shape["group_size"], shape["block_len"]
    ours = run(kernel, z, base, proj, grad, gs, L)
    ref = run(reference, z, base, proj, grad, gs, L)
    row = {**shape, "dtype": str(dtype).removeprefix("torch.")}
    if dtype == torch.float32:
        row["kernel_vs_torch"] = {n: rel(a, r) for n, a, r in zip(OUTPUTS, ours, ref)}
        row["ok"] = max(row["kernel_vs_torch"].values()) <= FLOAT32_TOL
    else:
        exact = run(reference, z.float(), base, proj.float(), grad.float(), gs, L)
        row["kernel_vs_float32"] = {n: rel(a, e) for n, a, e in zip(OUTPUTS, ours, exact)}
        row["torch_vs_float32"] = {n: rel(r, e) for n, r, e in zip(OUTPUTS, ref, exact)}
        row["ok"] = all(row["kernel_vs_float32"][n] <= max(row["torch_vs_float32"][n], BF16_ROUNDING)
                        for n in OUTPUTS)
    return row


def conv_on_gpu(device, rounds: int = 5, shape: dict = QWEN3_6_27B) -> dict:
    """At the 27B shape on CUDA: the comparison in float32 and bfloat16, and the forward and backward of each path
    in bfloat16 timed alternately (bench.measure.alternating over `rounds`, ms). "ok" is the comparison's; where it
    fails the check trains with the torch path and says so."""
    from bench.measure import alternating
    from dflash.drafter import conv_kernel
    from dflash.drafter.dflash2 import grouped_dynamic_conv

    out = {"shape": shape, "compared": {str(d).removeprefix("torch."): compare(
        conv_kernel.grouped_dynamic_conv, grouped_dynamic_conv, shape, d, device) for d in (torch.float32,
                                                                                          torch.bfloat16)}}
    out["ok"] = all(r["ok"] for r in out["compared"].values())
    z, base, proj, grad = inputs(shape, torch.bfloat16, device)
    paths = {"torch": grouped_dynamic_conv, "triton": conv_kernel.grouped_dynamic_conv}
    times = alternating({name: lambda conv=conv: run(conv, z, base, proj, grad, shape["group_size"],
                                                     shape["block_len"]) for name, conv in paths.items()}, rounds)
    out["fwd_bwd_ms"] = {k: round(t * 1e3, 3) for k, t in times.items()}
    out["torch_over_triton"] = round(out["fwd_bwd_ms"]["torch"] / out["fwd_bwd_ms"]["triton"], 2)
    return out
