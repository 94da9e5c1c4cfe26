"""The head's weighted cross-entropy: on given logits (`weighted_ce_sum`), and fused with the head over row chunks
(loss.fused_ce): sum_i w_i CE(head(h_i), y_i), the predictions, and d(sum)/dh made in the forward.

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

DFlash 2 (`FusedHeadSelectorCE`): the selector's K-way CE reads the same chunk's logits. Its gradient is taken in
the forward too, towards its own parameters, the hidden states (through its projection) and, coupled, the K + 1
unary scores it read; that last one goes back to the hidden states through the head's K + 1 rows and the output
scales' derivative, never as a dense [rows, V] gradient. The unary CE and the selector's CE keep their gradients
apart: the step weighs them by different factors (dflash.train.step), applied in backward.

The head must be frozen (the target's lm_head): its weight gets no gradient here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.drafter.selector_loss import selector_scores


class WeightedCE(torch.autograd.Function):
    """sum_i w_i CE(logits_i, labels_i), its gradient written in one [N, V] tensor: w_i g (softmax_i - onehot(label_i)),
    the softmax exp'd in place from the saved log-softmax, where autograd's cross_entropy zero-fills one for nll_loss's
    one-hot and makes another in log_softmax's backward (1.5% of a 512-anchor CPU step). Every label must be a token
    id (no ignore_index: the loss's rows are the labelled ones). The weights may carry a gradient (CE_i g)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        ce = -logp.gather(-1, labels[:, None])[:, 0]
        ctx.save_for_backward(logp, labels, weight, ce)
        return (ce * weight).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, labels, weight, ce = ctx.saved_tensors
        scale = weight * grad
        dlogits = _ce_gradient(logp.exp(), labels, scale) if ctx.needs_input_grad[0] else None
        return dlogits, None, (ce * grad).to(weight.dtype) if ctx.needs_input_grad[2] else None


def _ce_gradient(probs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale_i (softmax_i - onehot(labels_i)), the weighted CE's logits gradient, written into `probs` [N, V] (the
    softmax, a tensor the caller owns)."""
    probs.mul_(scale[:, None].to(probs.dtype))
    probs[torch.arange(len(labels), device=labels.device), labels] -= scale.to(probs.dtype)
    return probs


def _unary_chunk(logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                 want_h: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A chunk's weighted CE from its logits (made from the leaf h, their graph through it): (CE [n], argmax [n],
    d sum_i w_i CE_i / dh, or None without `want_h`)."""
    logp = torch.log_softmax(logits.detach(), -1)
    ce = -logp.gather(-1, labels[:, None])[:, 0]
    pred = logits.detach().argmax(-1)
    grad = torch.autograd.grad(logits, h, _ce_gradient(logp.exp_(), labels, weight))[0] if want_h else None
    return ce, pred, grad


def weighted_ce_sum(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i weight_i * CE(logits_i, labels_i) (`WeightedCE`): logits [N, V], labels and weight [N]."""
    return WeightedCE.apply(logits, labels, weight)


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
            ce[part], pred[part], g = _unary_chunk(logits, h, y, w, want_h)
            if want_h:
                grad_h[part] = g
            del logits
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


@dataclass(frozen=True)
class _Selector:
    """What FusedHeadSelectorCE needs besides tensors: the selector module, its options, the drafter's output
    scales (their derivative carries the unary scores' gradient to the hidden states), the chunking."""

    selector: torch.nn.Module
    options: object
    scales: object
    chunk_rows: int
    logits_fn: object


def _scales_derivative(scales, logits: torch.Tensor) -> torch.Tensor | float:
    """d finish(raw) / d raw at the finished logits (dflash.drafter.model.Scales.finish: a multiplier m, then a
    softcap c: c tanh(m raw / c)): m (1 - (logits / c)^2), or m without a cap."""
    m = scales.output_multiplier if scales is not None else 1.0
    cap = scales.final_logit_softcapping if scales is not None else None
    return m * (1 - (logits / cap) ** 2) if cap else m


class FusedHeadSelectorCE(torch.autograd.Function):
    """DFlash 2's chunk: the unary decay CE and the selector's CE (dflash.drafter.selector_loss.selector_ce's loss)
    with every gradient made in the forward. -> (unary CE sum, argmax [N], selector CE sum (weighted by sel_weight),
    choice [N], oracle [N], counted [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weight, prev, sel_weight, gold, how: _Selector, *params):
        N, opts = len(labels), how.options
        want_h = ctx.needs_input_grad[0]
        grad_unary = torch.zeros_like(hidden) if want_h else None
        grad_sel = torch.zeros_like(hidden) if want_h else None
        grad_params = [torch.zeros_like(p) for p in params]
        ce = torch.empty(N, dtype=torch.float32, device=hidden.device)
        sel_ce = torch.empty(N, dtype=torch.float32, device=hidden.device)
        pred, choice, oracle = (torch.empty_like(labels) for _ in range(3))
        counted = torch.empty(N, dtype=torch.bool, device=hidden.device)
        for start in range(0, N, how.chunk_rows):
            part = slice(start, start + how.chunk_rows)
            h = hidden[part].detach().requires_grad_(want_h)
            y, w, sw = labels[part], row_weight[part].detach(), sel_weight[part].detach()
            with torch.enable_grad():
                logits = how.logits_fn(h, weight)
            L = logits.detach()
            ce[part], pred[part], g = _unary_chunk(logits, h, y, w, want_h)
            if want_h:
                grad_unary[part] = g
            # the selector's CE on the same logits, its gradient taken here (the unary scores as a leaf)
            coupled, stop = opts.gradient == "coupled", opts.gradient == "stop"
            with torch.enable_grad():
                h_sel = hidden[part].detach().requires_grad_(want_h and not stop)
                out = selector_scores(how.selector, h_sel, L, y, prev[part], None if gold is None else gold[part],
                                      opts, unary_leaf=coupled)
                sel_sum = (out.terms.ce * sw).sum()
                leaves = [h_sel] if h_sel.requires_grad else []
                leaves += [out.unary] if coupled else []
                found = torch.autograd.grad(sel_sum, [*leaves, *params], allow_unused=True) \
                    if sel_sum.requires_grad else [None] * (len(leaves) + len(params))
            for acc, g in zip(grad_params, found[len(leaves):]):
                if g is not None:
                    acc += g
            sel_ce[part], choice[part], oracle[part], counted[part] = (t.detach() for t in out.terms)
            if want_h:
                g_sel = found[0].float() if h_sel.requires_grad else torch.zeros(h.shape, device=h.device)
                if coupled:  # the unary scores' gradient through the head's rows they read, sparsely
                    g_unary = found[len(leaves) - 1].float() * _scales_derivative(how.scales, L.gather(-1, out.index))
                    for j in range(out.index.shape[1]):
                        g_sel += g_unary[:, j, None] * F.embedding(out.index[:, j], weight).float()
                grad_sel[part] = g_sel.to(hidden.dtype)
            del logits
        for t in (pred, choice, oracle, counted):
            ctx.mark_non_differentiable(t)
        ctx.save_for_backward(grad_unary, grad_sel, *grad_params)
        unary_sum = (ce * row_weight.detach().float()).sum()
        return unary_sum, pred, (sel_ce * sel_weight.detach().float()).sum(), choice, oracle, counted

    @staticmethod
    def backward(ctx, g_unary, _pred, g_sel, *_):
        grad_unary, grad_sel, *grad_params = ctx.saved_tensors
        grad_h = None if grad_unary is None else grad_unary * g_unary.to(grad_unary.dtype) + \
            grad_sel * g_sel.to(grad_sel.dtype)
        return (grad_h, None, None, None, None, None, None, None, *(g * g_sel for g in grad_params))


def fused_head_selector_ce(hidden, weight, labels, row_weight, chunk_rows: int, logits_fn, selector, prev,
                           sel_weight, gold, options, scales) -> tuple:
    """`fused_head_ce` with DFlash 2's selector CE from the same logits (FusedHeadSelectorCE): (unary CE sum,
    predictions, selector CE sum, choices, oracle, counted), as dflash.drafter.loss.weighted_ce returns them."""
    if weight.requires_grad:
        raise ValueError("fused_head_selector_ce: the head weight requires a gradient; set loss.fused_ce=false")
    params = [p for p in selector.parameters() if p.requires_grad]
    how = _Selector(selector, options, scales, chunk_rows, logits_fn)
    return FusedHeadSelectorCE.apply(hidden, weight, labels, row_weight, prev, sel_weight, gold, how, *params)
