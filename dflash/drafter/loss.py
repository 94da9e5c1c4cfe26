"""Decay-weighted cross-entropy over block slots, chunked over rows so the full
[blocks x B x vocab] logits never exist at once (forward or backward)."""

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
               label_mask: torch.Tensor, gamma: float, chunk_logits: int = 0, rows: torch.Tensor | None = None):
    """The DFlash loss terms over packed blocks.

    hidden: [..., B, H] drafter outputs; labels/label_mask: [..., B]. Only rows with a label
    go through the LM head. Returns (loss_sum, weight_sum, predictions [..., B], -1 where
    there is no label); the loss is loss_sum / weight_sum, i.e. sum_k w_k CE_k / sum_k w_k
    over labelled slots. The caller divides, so that it can use the weight sum of a whole
    optimizer step across processes and micro-batches (exact distributed equivalence).
    rows: [N] those labelled rows' flat indices, `label_rows(label_mask)`, when the caller made them on the
    host: made here from a device mask, their count is read back (a host sync).
    """
    w = slot_weights(labels.shape[-1], gamma).to(hidden.device, non_blocking=True)  # blocking: a sync
    w = (w * label_mask).reshape(-1)
    rows = label_rows(label_mask) if rows is None else rows
    flat_h = hidden.reshape(-1, hidden.shape[-1])[rows]
    loss_sum, pred = weighted_ce(flat_h, lm_head_weight, labels.reshape(-1)[rows], w[rows], chunk_logits)
    predictions = torch.full(labels.shape, -1, dtype=torch.long, device=labels.device)
    predictions.view(-1)[rows] = pred
    return loss_sum, w.sum(), predictions


def label_rows(label_mask: torch.Tensor) -> torch.Tensor:
    """[N] flat indices of the labelled slots of label_mask [..., B] (the rows block_loss scores)."""
    return label_mask.reshape(-1).nonzero().flatten()
