"""The chunked head loss at a large vocabulary: loss.fused_ce (each chunk's gradient made in the forward,
dflash.drafter.head_ce.py) against the chunks recomputed in backward (loss.fused_ce=false), side by side.

    python -m bench --only head_loss

The shape is the Qwen3.6-27B drafter's head at 1/8 of its width and vocabulary (hidden 5120 -> 640, vocabulary
248320 -> 31040; 128 blocks of 8, 7 labelled rows each), cut into as many chunks as the 27B step's default
loss.chunk_logits makes there (7). What is timed is the loss's forward and backward from the drafter's output
rows: the head's matmuls and the softmax, where the recompute costs a third of the matmuls; for DFlash and for
DFlash 2 (the selector's CE, coupled, from the same chunks).
"""

from __future__ import annotations

import torch

from bench.measure import alternating
from dflash.drafter.dflash2 import CandidateSelector
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
    prev = torch.randint(0, V, (N,), generator=g).to(device)
    weights = slot_weights(8, 7.0)[1:].repeat(N // 7 + 1)[:N].to(device)
    torch.manual_seed(0)  # DFlash 2's selector at the published top-16, rank 256 over 8 = 32 as the vocabulary
    selector = CandidateSelector(H, V, rank=32, top_k=16).to(device)
    out = {}

    def step(fused: bool, dflash2: bool):
        def run():
            h = hidden.detach().requires_grad_(True)
            sel = {"selector": selector, "prev": prev, "sel_weight": weights} if dflash2 else {}
            got = weighted_ce(h, head, labels, weights, chunk_logits, fused=fused, **sel)
            (got[0] + got[2] if dflash2 else got[0]).backward()
            out[fused, dflash2] = (got[0].detach(), h.grad)
        return run

    arms = {f"{kind}_{how}": step(how == "fused", kind == "dflash2") for kind in ("dflash", "dflash2")
            for how in ("recompute", "fused")}
    times = alternating(arms, 2 if quick else 3)
    found = {"shape": shape, "chunk_logits": chunk_logits, "fwd_bwd_s": {k: round(v, 4) for k, v in times.items()}}
    for kind, two in (("dflash", False), ("dflash2", True)):
        (loss_f, grad_f), (loss_r, grad_r) = out[True, two], out[False, two]
        found[kind] = {"recompute_over_fused": round(times[f"{kind}_recompute"] / times[f"{kind}_fused"], 3),
                       "loss_rel_diff": float((loss_f - loss_r).abs() / loss_r.abs()),
                       "grad_rel_diff": float((grad_f - grad_r).abs().max() / grad_r.abs().max())}
    found["recompute_over_fused"] = found["dflash"]["recompute_over_fused"]
    return found
