"""The learning-rate schedule and the AdamW parameter groups of dflash.train.optim."""

import itertools
import math

import pytest
import torch

from dflash.config import OptimConfig
from dflash.train.optim import build_optimizer, build_scheduler, warmup_steps

LR = 1e-3


def lrs(cfg: OptimConfig, total_steps: int) -> list[float]:
    """The learning rate of optimizer steps 0..total_steps, stepping the scheduler as the loop does."""
    optimizer = build_optimizer(torch.nn.Linear(2, 2), cfg)
    scheduler = build_scheduler(optimizer, total_steps, cfg)
    seen = []
    for _ in range(total_steps + 1):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_is_linear_from_zero_to_the_peak():
    cfg = OptimConfig(lr=LR, warmup_ratio=0.1, min_lr_ratio=0.1)
    seen = lrs(cfg, 100)
    assert warmup_steps(100, cfg) == 10
    assert seen[0] == 0.0
    assert seen[:11] == pytest.approx([LR * s / 10 for s in range(11)])
    assert seen[10] == pytest.approx(LR) and max(seen) == pytest.approx(LR)


def test_warmup_steps_round_up():
    cfg = OptimConfig(lr=LR, warmup_ratio=0.04)
    assert warmup_steps(30, cfg) == 2  # ceil(1.2)
    assert lrs(cfg, 30)[:3] == pytest.approx([0.0, LR / 2, LR])


def test_cosine_decays_monotonically_to_the_floor_at_the_last_step():
    cfg = OptimConfig(lr=LR, warmup_ratio=0.1, min_lr_ratio=0.1)
    seen = lrs(cfg, 100)
    after = seen[10:]
    assert all(b <= a for a, b in itertools.pairwise(after))
    assert seen[100] == pytest.approx(0.1 * LR)
    # halfway through the decay the cosine is at the middle of [floor, peak]
    assert seen[55] == pytest.approx(LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))


def test_cosine_with_no_floor_ends_at_zero():
    seen = lrs(OptimConfig(lr=LR, warmup_ratio=0.1), 50)
    assert seen[50] == pytest.approx(0.0, abs=1e-12)


def test_constant_schedule_is_flat_after_warmup():
    seen = lrs(OptimConfig(lr=LR, schedule="constant", warmup_ratio=0.1), 50)
    assert seen[:6] == pytest.approx([LR * s / 5 for s in range(6)])
    assert seen[5:] == [seen[5]] * 46 and seen[5] == pytest.approx(LR)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_no_warmup_starts_at_the_peak(schedule):
    cfg = OptimConfig(lr=LR, schedule=schedule, warmup_ratio=0.0)
    assert warmup_steps(20, cfg) == 0
    assert lrs(cfg, 20)[0] == pytest.approx(LR)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.input_layernorm = torch.nn.LayerNorm(4)
        self.norm_table = torch.nn.Parameter(torch.ones(2, 4))  # 2-D, but a norm by its name
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_norms_and_biases_get_no_weight_decay():
    model = Block()
    cfg = OptimConfig(lr=LR, weight_decay=0.1, betas=[0.8, 0.9], eps=1e-6)
    decay, no_decay = build_optimizer(model, cfg).param_groups
    # exact sets: the frozen layer is in neither group
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight)} and decay["weight_decay"] == 0.1
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in (
        model.proj.bias, model.input_layernorm.weight, model.input_layernorm.bias, model.norm_table)}
    assert no_decay["weight_decay"] == 0.0
    for group in (decay, no_decay):
        assert group["lr"] == LR and group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6
