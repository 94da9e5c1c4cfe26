"""AdamW and the learning-rate schedule (a pure function of the step, as in nanoGPT)."""

from __future__ import annotations

import math

import torch

from dflash.config import OptimConfig


def lr_multiplier(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Factor on cfg.lr at optimizer step `step` (0-based): linear warmup over warmup_ratio of
    the steps, then constant or cosine decay to min_lr_ratio at the last step."""
    warmup = int(math.ceil(cfg.warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; norms and biases get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
