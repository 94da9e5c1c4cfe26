"""AdamW and the learning-rate schedule: transformers' warmup + cosine (with a floor) or constant."""

from __future__ import annotations

import math

import torch

from dflash.config import OptimConfig


def warmup_steps(total_steps: int, cfg: OptimConfig) -> int:
    return int(math.ceil(cfg.warmup_ratio * total_steps))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; norms and biases get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    """Linear warmup from 0 over warmup_ratio of the steps, then cosine decay to min_lr_ratio x lr
    at `total_steps` (or constant). Stepped once per optimizer step."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = warmup_steps(total_steps, cfg)
    if cfg.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps, min_lr_rate=cfg.min_lr_ratio)
