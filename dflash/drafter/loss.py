"""The drafter's loss over block slots, chunked over rows so the full [blocks x B x vocab] logits never exist at
once (forward or backward).

Per labelled slot k (1 <= k < B; slot 0 is the given token and never counts) a row loss l_k, weighted:
- decay_ce: l_k = CE(drafter, label), w_k = exp(-(k-1)/gamma) (the DFlash paper, Eq. 4);
- dpace: l_k = CE, w_k the D-PACE weight (`dpace_weights`, arXiv 2605.18810), computed without gradient from
  the drafter's own probability of the labels in the same forward;
- kl: l_k = KL(p_target || q_drafter) at the label's position, weighted by either.
The caller divides the weighted sum by a normaliser (the sum of the weights, or the count of valid anchors) taken
over a whole optimizer step on all processes, so accumulation and DDP stay exact (dflash.train.step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights: slot 0 (the given token) 0, slot k >= 1 exp(-(k-1)/gamma)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def _chunk_ce(hidden, weight, labels, row_weight):
    logits = F.linear(hidden, weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * row_weight).sum(), logits.argmax(-1)


def weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                row_weight: torch.Tensor, chunk_logits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of row_weight * CE(lm_head(hidden), labels) and the argmax predictions.

    hidden: [N, H]; labels, row_weight: [N]. When N x vocab exceeds chunk_logits (> 0), the
    logits are made chunk by chunk of rows and recomputed in backward (activation
    checkpointing), so peak memory holds one chunk's logits instead of N x vocab; below it
    they are made at once (no recompute). Returns (loss_sum, predictions [N]).
    """
    chunk_rows = max(1, chunk_logits // lm_head_weight.shape[0]) if chunk_logits > 0 else hidden.shape[0]
    if hidden.shape[0] <= chunk_rows:
        return _chunk_ce(hidden, lm_head_weight, labels, row_weight)
    total, preds = hidden.new_zeros((), dtype=torch.float32), []
    # split, not per-chunk slices: a slice's backward writes a zero gradient the size of all of `hidden`
    for h, y, w in zip(hidden.split(chunk_rows), labels.split(chunk_rows), row_weight.split(chunk_rows)):
        part, pred = checkpoint(_chunk_ce, h, lm_head_weight, y, w, use_reentrant=False)
        total = total + part
        preds.append(pred)
    return total, torch.cat(preds)


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
               label_mask: torch.Tensor, gamma: float, chunk_logits: int = 0, rows: torch.Tensor | None = None, *,
               weighting: str = "decay", alpha: float = 0.5, target_logits: torch.Tensor | None = None,
               target_topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """The DFlash loss terms over packed blocks.

    hidden: [..., B, H] drafter outputs; labels/label_mask: [..., B]. Only rows with a label
    go through the LM head. Returns (loss_sum, weight_sum, predictions [..., B], -1 where
    there is no label); with the paper's normalisation the loss is loss_sum / weight_sum, i.e.
    sum_k w_k l_k / sum_k w_k over labelled slots. The caller divides, so that it can use the
    normaliser of a whole optimizer step across processes and micro-batches (exact distributed
    equivalence). weight_sum carries no gradient.
    rows: [N] those labelled rows' flat indices, `label_rows(label_mask)`, when the caller made them on the
    host: made here from a device mask, their count is read back (a host sync).
    weighting: decay (w_k = exp(-(k-1)/gamma)) or dpace (`dpace_weights` with `alpha`; gamma unused).
    target_logits: [N, V] the target's logits predicting each labelled row's token (`label_logits`): given,
    the row loss is KL(softmax(target) || softmax(drafter)) instead of CE on the label.
    target_topk: (logprobs [N, k], ids [N, k], rest [N]) the target's stored top-k distribution instead
    (features.topk_logits): the row loss is the KL between the two distributions coarsened to those k tokens
    and one bucket for all the others (exact when k = vocab; below, a lower bound of the full KL).
    """
    rows = label_rows(label_mask) if rows is None else rows
    if weighting == "decay" and target_logits is None and target_topk is None:  # the paper's loss, unchanged
        w = slot_weights(labels.shape[-1], gamma).to(hidden.device, non_blocking=True)  # blocking: a sync
        w = (w * label_mask).reshape(-1)
        flat_h = hidden.reshape(-1, hidden.shape[-1])[rows]
        loss_sum, pred = weighted_ce(flat_h, lm_head_weight, labels.reshape(-1)[rows], w[rows], chunk_logits)
        return loss_sum, w.sum(), _scatter_predictions(labels, rows, pred)
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"weighting={weighting!r}: decay or dpace")
    flat_h = hidden.reshape(-1, hidden.shape[-1])[rows]
    row_loss, ce, pred = row_losses(flat_h, lm_head_weight, labels.reshape(-1)[rows], chunk_logits, target_logits,
                                    target_topk)
    if weighting == "dpace":
        q = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
        q[rows] = torch.exp(-ce.detach().float())
        w = dpace_weights(q.view(labels.shape), label_mask, alpha).reshape(-1)
    else:
        w = (slot_weights(labels.shape[-1], gamma).to(hidden.device) * label_mask).reshape(-1)
    loss_sum = (row_loss * w[rows]).sum()
    return loss_sum, w.sum(), _scatter_predictions(labels, rows, pred)


def _scatter_predictions(labels: torch.Tensor, rows: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    predictions = torch.full(labels.shape, -1, dtype=torch.long, device=labels.device)
    predictions.view(-1)[rows] = pred
    return predictions


def dpace_weights(q: torch.Tensor, label_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [..., B] (arXiv 2605.18810, Eqs. 7-8), without gradient.

    q: [..., B] the drafter's probability of each slot's label, exp(-CE); label_mask: [..., B].
    Smoothed confidence q~_i = (1 - alpha) q_i + alpha (Eq. 7), and for slot j

        w_j = sum_{m >= j} prod_{i <= m} q~_i        (Eq. 8)

    the expected number of accepted tokens from slot j on (slot m is accepted when slots 1..m all are), so a
    slot weighs as much as the acceptance length it can still unlock. Slot 0 (no label) and masked slots
    neither weigh (w = 0) nor count: their q~ is 1 in the products and their terms are left out of the sums.
    alpha = 1 gives w_j = number of labelled slots >= j.
    """
    with torch.no_grad():
        mask = label_mask.to(q.dtype)
        smoothed = torch.where(label_mask.bool(), (1 - alpha) * q + alpha, torch.ones_like(q))
        reach = torch.cumprod(smoothed, dim=-1) * mask  # prod_{i<=m} q~_i of labelled slots m
        return reach.flip(-1).cumsum(-1).flip(-1) * mask


def _chunk_rows(hidden, weight, labels, target_logits, top_logprobs=None, top_ids=None, top_rest=None):
    logits = F.linear(hidden, weight).float()
    logq = F.log_softmax(logits, dim=-1)
    ce = -logq.gather(-1, labels[:, None]).squeeze(-1)
    if target_logits is not None:
        logp = F.log_softmax(target_logits.float(), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1), ce, logits.argmax(-1)
    if top_ids is None:
        return ce, ce, logits.argmax(-1)
    logq_top = logq.gather(-1, top_ids)
    # the drafter's mass outside the k tokens, in log space; a large negative (not -inf) keeps the gradient
    # finite where the k tokens are the whole vocabulary (then rest = 0 and the term vanishes)
    log_q_rest = torch.logsumexp(logq.scatter(-1, top_ids, -1e4), dim=-1)
    lp = top_logprobs.float()
    rest = top_rest.float()
    kl = (lp.exp() * (lp - logq_top)).sum(-1) + rest * (torch.log(rest.clamp_min(1e-30)) - log_q_rest)
    return kl, ce, logits.argmax(-1)


def row_losses(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk_logits: int = 0,
               target_logits: torch.Tensor | None = None, target_topk: tuple | None = None):
    """Per-row losses of hidden [N, H]: (row_loss [N], ce [N], predictions [N]); row_loss is ce, or with
    target_logits [N, V] KL(softmax(target) || softmax(drafter)), or with target_topk (block_loss) the
    top-k KL. Chunked over rows as `weighted_ce`."""
    chunk_rows = max(1, chunk_logits // lm_head_weight.shape[0]) if chunk_logits > 0 else hidden.shape[0]
    top = tuple(target_topk) if target_topk is not None else (None, None, None)
    if hidden.shape[0] <= chunk_rows:
        return _chunk_rows(hidden, lm_head_weight, labels, target_logits, *top)
    n = len(labels.split(chunk_rows))
    split = lambda t: [None] * n if t is None else t.split(chunk_rows)  # noqa: E731
    parts = []
    for h, y, t, *tk in zip(hidden.split(chunk_rows), labels.split(chunk_rows), split(target_logits),
                            *(split(t) for t in top)):
        parts.append(checkpoint(_chunk_rows, h, lm_head_weight, y, t, *tk, use_reentrant=False))
    return tuple(torch.cat(p) for p in zip(*parts))


def label_logits(logits: torch.Tensor, anchors: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, ...] the target's logits (or any per-position tensor [b, L, ...]: stored top-k distributions) that
    predict each labelled row's token: slot k of the block at anchor a is x_{a+k}, predicted at position
    a+k-1. logits: [b, L, ...]; anchors: [b, n]; rows: [N] flat indices into [b, n, B] (`label_rows`)."""
    b, L = logits.shape[:2]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1  # [b, n, B]
    flat = (torch.arange(b, device=anchors.device)[:, None, None] * L + pos.clamp(0, L - 1)).reshape(-1)
    return logits.reshape(b * L, *logits.shape[2:])[flat[rows]]


def label_rows(label_mask: torch.Tensor) -> torch.Tensor:
    """[N] flat indices of the labelled slots of label_mask [..., B] (the rows block_loss scores)."""
    return label_mask.reshape(-1).nonzero().flatten()
