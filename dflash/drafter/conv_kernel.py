"""DFlash 2's grouped dynamic convolution as two Triton kernels (forward; backward), for training on GPUs.

The torch path (dflash.drafter.dflash2._BlockConv) is the oracle and the fallback: exports and CPU runs use it,
and `train.conv_kernel` (auto | torch | triton) chooses. Per block of L queries, for each query t at position p
of its block and channel c of group g = c // group_size:

    out[t, c]      = sum_{o <= min(k - 1, p)} (base[o, c] + taps[t, o, g]) * z[t - o, c]
    grad_z[t, c]   = sum_{o < k, p + o < L} grad[t + o, c] * (base[o, c] + taps[t + o, o, g])
    grad_taps[t, o, g] = sum_{c in g} grad[t, c] * z[t - o, c]          (p >= o)
    grad_base[o, c]    = sum_t grad[t, c] * z[t - o, c]                 (p >= o)

The torch path writes several full-size temporaries a pass (base + taps broadcast over the group, the products,
the shifted slices); here each pass reads z (and grad) once per tap and writes its outputs once, accumulating in
float32. grad_base is summed per tile of rows into a [tiles, k, H] float32 buffer, then over the tiles by torch
(deterministic, no atomics).

Importing this module needs triton; dflash.drafter.build imports it only when the kernel is chosen. Under
TRITON_INTERPRET=1 the kernels run on CPU tensors (slowly): the engines check compares them with the torch path
there (bench/engines/conv_check.py), the GPU test on CUDA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash.drafter import dflash2

BLOCK_ROWS = 32
BLOCK_GROUPS = 8


@triton.jit
def _forward(z, base, taps, out, R, H, G, L, s_tr, s_to,
             K: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    groups = tl.program_id(1) * BG + tl.arange(0, BG)
    chan = groups[:, None] * GS + tl.arange(0, GS)[None, :]  # [BG, GS]
    rmask, gmask = rows < R, groups < G
    pos = rows % L
    acc = tl.zeros((BR, BG, GS), dtype=tl.float32)
    for o in tl.static_range(K):
        ok = rmask & (pos >= o)
        zo = tl.load(z + (rows - o)[:, None, None] * H + chan[None, :, :],
                     mask=ok[:, None, None] & gmask[None, :, None], other=0.0).to(tl.float32)
        t = tl.load(taps + rows[:, None] * s_tr + o * s_to + groups[None, :],
                    mask=ok[:, None] & gmask[None, :], other=0.0).to(tl.float32)
        b = tl.load(base + o * H + chan, mask=gmask[:, None], other=0.0).to(tl.float32)
        acc += zo * (b[None, :, :] + t[:, :, None])
    tl.store(out + rows[:, None, None] * H + chan[None, :, :], acc.to(out.dtype.element_ty),
             mask=rmask[:, None, None] & gmask[None, :, None])


@triton.jit
def _backward(z, base, taps, grad, grad_z, grad_taps, grad_base, R, H, G, L, s_tr, s_to,
              K: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile * BR + tl.arange(0, BR)
    groups = tl.program_id(1) * BG + tl.arange(0, BG)
    chan = groups[:, None] * GS + tl.arange(0, GS)[None, :]
    rmask, gmask = rows < R, groups < G
    pos = rows % L
    cmask = rmask[:, None, None] & gmask[None, :, None]
    g = tl.load(grad + rows[:, None, None] * H + chan[None, :, :], mask=cmask, other=0.0).to(tl.float32)
    gz = tl.zeros((BR, BG, GS), dtype=tl.float32)
    for o in tl.static_range(K):
        b = tl.load(base + o * H + chan, mask=gmask[:, None], other=0.0).to(tl.float32)
        # what this row's input gave to row + o (same block): grad_z
        ahead = rmask & (pos + o < L) & (rows + o < R)
        ga = tl.load(grad + (rows + o)[:, None, None] * H + chan[None, :, :],
                     mask=ahead[:, None, None] & gmask[None, :, None], other=0.0).to(tl.float32)
        ta = tl.load(taps + (rows + o)[:, None] * s_tr + o * s_to + groups[None, :],
                     mask=ahead[:, None] & gmask[None, :], other=0.0).to(tl.float32)
        gz += ga * (b[None, :, :] + ta[:, :, None])
        # what row - o's input times this row's gradient gives the taps and the base
        back = rmask & (pos >= o)
        zo = tl.load(z + (rows - o)[:, None, None] * H + chan[None, :, :],
                     mask=back[:, None, None] & gmask[None, :, None], other=0.0).to(tl.float32)
        prod = g * zo
        tl.store(grad_taps + rows[:, None] * (K * G) + o * G + groups[None, :],
                 tl.sum(prod, axis=2).to(grad_taps.dtype.element_ty), mask=rmask[:, None] & gmask[None, :])
        tl.store(grad_base + tile * (K * H) + o * H + chan, tl.sum(prod, axis=0), mask=gmask[:, None])
    tl.store(grad_z + rows[:, None, None] * H + chan[None, :, :], gz.to(grad_z.dtype.element_ty), mask=cmask)


def _runs_here(z: torch.Tensor) -> bool:
    return z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


class _TritonConv(torch.autograd.Function):
    """z [R, H] (rows of blocks of L), base [k, H], taps [R, k, G] (any row and tap strides, groups contiguous)."""

    @staticmethod
    def forward(ctx, z, base, taps, block_len, group_size):
        R, H = z.shape
        k, G = base.shape[0], taps.shape[-1]
        z, base = z.contiguous(), base.contiguous()
        if taps.stride(-1) != 1:
            taps = taps.contiguous()
        out = torch.empty_like(z)
        grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(G, BLOCK_GROUPS))
        _forward[grid](z, base, taps, out, R, H, G, block_len, taps.stride(0), taps.stride(1),
                       K=k, GS=group_size, BR=BLOCK_ROWS, BG=BLOCK_GROUPS)
        ctx.save_for_backward(z, base, taps)
        ctx.block_len, ctx.group_size = block_len, group_size
        return out

    @staticmethod
    def backward(ctx, grad):
        z, base, taps = ctx.saved_tensors
        R, H = z.shape
        k, G = base.shape[0], taps.shape[-1]
        grad = grad.contiguous()
        tiles = triton.cdiv(R, BLOCK_ROWS)
        grad_z = torch.empty_like(z)
        grad_taps = torch.empty(R, k, G, dtype=taps.dtype, device=taps.device)
        partial = torch.empty(tiles, k, H, dtype=torch.float32, device=z.device)
        _backward[(tiles, triton.cdiv(G, BLOCK_GROUPS))](
            z, base, taps, grad, grad_z, grad_taps, partial, R, H, G, ctx.block_len, taps.stride(0), taps.stride(1),
            K=k, GS=ctx.group_size, BR=BLOCK_ROWS, BG=BLOCK_GROUPS)
        return grad_z, partial.sum(0).to(base.dtype), grad_taps, None, None


def grouped_dynamic_conv(z: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, group_size: int,
                         block_len: int) -> torch.Tensor:
    """dflash.drafter.dflash2.grouped_dynamic_conv through the Triton kernels, same arguments and result (the group
    size a power of two: a group's channels are one vector; dflash.drafter.build.use_conv_kernel checks it); the
    torch path for a CPU tensor outside the interpreter (a drafter moved to the CPU after training)."""
    b, q, H = z.shape
    if not _runs_here(z):
        return dflash2.grouped_dynamic_conv(z, base, dynamic, group_size, block_len)
    block_len = min(block_len, q)
    if q % block_len:
        raise ValueError(f"{q} queries are not whole blocks of {block_len}")
    k, G = base.shape[0], H // group_size
    out = _TritonConv.apply(z.reshape(b * q, H), base.to(z.dtype), dynamic.reshape(b * q, k, G).to(z.dtype),
                            block_len, group_size)
    return out.reshape(b, q, H)
