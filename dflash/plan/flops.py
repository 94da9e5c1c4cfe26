"""Model FLOPs of a drafter training step, as the GPU check's MFU and the plan's GPU-hours count them."""

from __future__ import annotations

import torch


def visible_pairs(blocks, window: int | None) -> float:
    """(query, key) pairs the packed mask lets real blocks see. Full attention: each query sees the
    context before its anchor and its block's B keys. Sliding (window W): slot k at position anchor + k
    sees the context from anchor + k - (W - 1) on and the block's first k + 1 keys."""
    B = blocks.block_size
    anchors = blocks.anchors.float()[blocks.valid]  # [m]
    if window is None:
        return float((anchors + B).sum()) * B
    k = torch.arange(B, dtype=torch.float32, device=anchors.device)
    ctx = anchors[:, None] - (anchors[:, None] + k - (window - 1)).clamp(min=0)  # [m, B]
    return float((ctx.clamp(min=0) + k + 1).sum())


def train_flops(drafter, blocks) -> dict:
    """Model FLOPs of one training step, padding excluded: 2 per multiply-add; backward twice the
    forward for trained weights, once for frozen ones (fc passes no gradient to the features, the LM
    head none to its weight); attention over the pairs each layer's mask makes visible
    (`visible_pairs`). {"matmul": ..., "attention": ...}."""
    c, B = drafter.config, drafter.block_size
    H, hd, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    b, n = blocks.anchors.shape
    L, Q = blocks.ctx_len * b, n * B * b
    per_layer = 2 * Q * H * nh * hd * 2 + 2 * (L + Q) * H * nkv * hd * 2 + 2 * Q * H * c.intermediate_size * 3
    fc = 2 * L * drafter.fc.in_features * H
    head = 2 * float(blocks.label_mask.sum()) * H * c.vocab_size
    windows = [c.sliding_window if t == "sliding_attention" else None for t in drafter.layer_types]
    return {"matmul": 3 * len(drafter.layers) * per_layer + 2 * fc + 2 * head,
            "attention": sum(3 * 4 * visible_pairs(blocks, w) * hd * nh for w in windows)}
