"""The chunked head loss at a large vocabulary: loss.fused_ce (each chunk's gradient made in the forward,
dflash/drafter/fused_ce.py) against the chunks recomputed in backward (loss.fused_ce=false), side by side.

    python -m bench --only head_loss

The shape is the Qwen3.6-27B drafter's head at 1/8 of its width and vocabulary (hidden 5120 -> 640, vocabulary
248320 -> 31040; 128 blocks of 8, 7 labelled rows each), cut into as many chunks as the 27B step's default
loss.chunk_logits makes there (7). What is timed is the loss's forward and backward from the drafter's output
rows: the head's matmuls and the softmax, where the recompute costs a third of the matmuls.
"""

from __future__ import annotations

import torch

from bench.measure import alternating
from dflash.drafter.loss import slot_weights, weighted_ce

SHAPE = {"hidden": 640, "vocab": 31040, "rows": 896, "chunks": 7}
QUICK = {"hidden": 320, "vocab": 15520, "rows": 448, "chunks": 7}


def head_loss_costs(quick: bool, device, **_) -> dict:
    shape = QUICK if quick else SHAPE
    H, V, N = shape["hidden"], shape["vocab"], shape["rows"]
    chunk_logits = -(-N // shape["chunks"]) * V
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(device)
    head = (torch.randn(V, H, generator=g) / H**0.5).to(device)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    weights = slot_weights(8, 7.0)[1:].repeat(N // 7 + 1)[:N].to(device)
    out = {}

    def step(fused: bool):
        def run():
            h = hidden.detach().requires_grad_(True)
            loss, _ = weighted_ce(h, head, labels, weights, chunk_logits, fused=fused)
            loss.backward()
            out[fused] = (loss.detach(), h.grad)
        return run

    times = alternating({"recompute": step(False), "fused": step(True)}, 2 if quick else 3)
    (loss_f, grad_f), (loss_r, grad_r) = out[True], out[False]
    return {"shape": shape, "chunk_logits": chunk_logits, "fwd_bwd_s": {k: round(v, 4) for k, v in times.items()},
            "recompute_over_fused": round(times["recompute"] / times["fused"], 3),
            "loss_rel_diff": float((loss_f - loss_r).abs() / loss_r.abs()),
            "grad_rel_diff": float((grad_f - grad_r).abs().max() / grad_r.abs().max())}
