"""Per-position accuracy, streak and tau: one implementation for training and evaluation.

For a block at anchor p, slot k (1..B-1) is correct when the drafter's argmax equals x_{p+k}.
streak = consecutive correct slots from slot 1 (stopping at the first wrong or unlabelled
slot); tau = streak + 1, the tokens a greedy verification step commits.
"""

from __future__ import annotations

import torch


def slot_correct(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor):
    """(correct, valid) for slots 1..B-1: each [..., B-1] bool."""
    valid = label_mask[..., 1:]
    return (predictions[..., 1:] == labels[..., 1:]) & valid, valid


def streaks(correct: torch.Tensor) -> torch.Tensor:
    """[...] consecutive correct slots from slot 1. correct: [..., B-1] (already masked)."""
    return correct.long().cumprod(-1).sum(-1)


def count(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> dict:
    """Summable counts over the blocks of a batch (blocks = those with slot 1 labelled): correct, valid [B-1]
    and streak, blocks [], float64 on the predictions' device. Other blocks are masked out rather than
    selected, so nothing waits for the device (a boolean selection reads its size back); the training loop
    sums these over a log window before reading them."""
    correct, valid = slot_correct(predictions, labels, label_mask)
    blocks = valid[..., :1]
    correct, valid = (correct & blocks).flatten(0, -2), (valid & blocks).flatten(0, -2)
    return {
        "correct": correct.sum(0).double(),
        "valid": valid.sum(0).double(),
        "streak": streaks(correct).sum().double(),
        "blocks": blocks.sum().double(),
    }


def add(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {k: a[k] + b[k] for k in a}


def finalize(counts: dict, prefix: str) -> dict:
    """`{prefix}/acc@k` (k = 1..B-1), `{prefix}/streak`, `{prefix}/tau` from summed counts."""
    out = {}
    valid = counts["valid"].clamp_min(1)
    for k, acc in enumerate((counts["correct"] / valid).tolist(), start=1):
        out[f"{prefix}/acc@{k}"] = acc
    blocks = max(float(counts["blocks"]), 1.0)
    out[f"{prefix}/streak"] = float(counts["streak"]) / blocks
    out[f"{prefix}/tau"] = out[f"{prefix}/streak"] + 1.0
    return out


def tau_histogram(taus, block_size: int) -> list[int]:
    """Counts of tau = 1..B."""
    hist = [0] * block_size
    for t in taus:
        hist[int(t) - 1] += 1
    return hist


def ratio_se(pairs: list[tuple[float, float]]) -> float:
    """Standard error of sum(x) / sum(y) over independent units (prompts) given as (x, y) pairs, e.g. (tokens,
    blocks) per prompt for a pooled tau: the delta method, sqrt(sum (x_i - R y_i)^2 / (n (n - 1))) / mean(y).
    NaN for fewer than two units."""
    n = len(pairs)
    if n < 2 or not sum(y for _, y in pairs):
        return float("nan")
    ratio = sum(x for x, _ in pairs) / sum(y for _, y in pairs)
    spread = sum((x - ratio * y) ** 2 for x, y in pairs) / (n * (n - 1))
    return spread ** 0.5 / (sum(y for _, y in pairs) / n)
