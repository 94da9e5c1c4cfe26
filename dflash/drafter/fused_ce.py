"""The head's weighted cross-entropy over row chunks with its gradient made in the forward (a fused linear
cross-entropy, loss.fused_ce): sum_i w_i CE(head(h_i), y_i), the predictions, and d(sum)/dh kept for backward.

The chunked path before it (loss.fused_ce=false: dflash.drafter.loss.weighted_ce under activation checkpointing)
runs each chunk's head matmul and softmax twice, once in the forward and again in backward to get the gradient.
Here each chunk's logits are made once: its loss, its argmax and its gradient to the hidden states
(w_i (softmax_i - onehot(y_i)) back through the head and the target's output scales) come from them, and they are
freed before the next chunk. Backward scales the kept [N, H] gradient by the incoming one. At a 248k vocabulary
the head is most of the step's matmul work, a third of it the recompute.

Maintained kernels were read first: Liger-Kernel's fused linear cross-entropy has no per-token weights (its
issue #338) and until its PR #1298 (2026-07) returned a wrong gradient for reduction="none" with a per-token
upstream gradient, the way per-slot weights would go through it; torch 2.13's F.linear_cross_entropy weighs
classes, not rows, and the GPU machines run torch 2.11. Our slot weights (decay, or any weight the caller hands
in) and the target's softcap and output multiplier (`Scales`) go through this one.

The head must be frozen (the target's lm_head): its weight gets no gradient here. DFlash 2's selector, which
reads the same logits and trains through them, keeps the checkpointed path.
"""

from __future__ import annotations

import torch


class FusedHeadCE(torch.autograd.Function):
    """hidden [N, H], head weight [V, H] (frozen), labels [N], row weights [N] -> (sum_i w_i CE_i, argmax [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weight, chunk_rows: int, logits_fn):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        grad_h = torch.empty_like(hidden) if want_h else None
        ce, pred = torch.empty(len(labels), dtype=torch.float32, device=hidden.device), torch.empty_like(labels)
        for start in range(0, len(labels), chunk_rows):
            part = slice(start, start + chunk_rows)
            h = hidden[part].detach().requires_grad_(want_h)
            y, w = labels[part], row_weight[part].detach()
            with torch.enable_grad():
                logits = logits_fn(h, weight)  # float32 [n, V]; its graph (through h only) lives for this chunk
            logp = torch.log_softmax(logits.detach(), -1)
            ce[part] = -logp.gather(-1, y[:, None])[:, 0]
            pred[part] = logits.detach().argmax(-1)
            if want_h:
                dlogits = logp.exp_().mul_(w[:, None].to(logp.dtype))  # w (softmax - onehot), in place
                dlogits[torch.arange(len(y), device=y.device), y] -= w.to(logp.dtype)
                grad_h[part] = torch.autograd.grad(logits, h, dlogits)[0]
            del logits, logp
        ctx.mark_non_differentiable(pred)
        ctx.save_for_backward(grad_h if want_h else None, ce if want_w else None)
        return (ce * row_weight.detach().float()).sum(), pred

    @staticmethod
    def backward(ctx, grad, _):
        grad_h, ce = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad.to(grad_h.dtype), None, None,
                None if ce is None else ce * grad, None, None)


def fused_head_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weight: torch.Tensor,
                  chunk_rows: int, logits_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i row_weight_i CE(logits_fn(hidden_i, weight), labels_i), argmax predictions [N]), chunk_rows rows of
    logits at a time; logits_fn(h, weight) -> float32 logits (dflash.drafter.loss.head_logits with the drafter's
    scales). The head weight must not require a gradient."""
    if weight.requires_grad:
        raise ValueError("fused_head_ce: the head weight requires a gradient; this path trains the hidden states "
                         "only (set loss.fused_ce=false to train the head)")
    return FusedHeadCE.apply(hidden, weight, labels, row_weight, chunk_rows, logits_fn)
