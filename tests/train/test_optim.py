"""The learning-rate schedule and the AdamW parameter groups of dflash.train.optim."""

import itertools
import math

import pytest
import torch

from dflash.config import OptimConfig
from dflash.errors import ConfigError
from dflash.train.optim import (MuonAdamW, build_optimizer, build_scheduler, check_optimizer, is_muon_param,
                                   warmup_steps)

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


class Selectorish(torch.nn.Module):
    """DFlash 2's selector's parameter names: two codebooks and a projection."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.candidate_selector = torch.nn.Module()
        self.candidate_selector.predecessor_codebook = torch.nn.Parameter(torch.ones(6, 2))
        self.candidate_selector.successor_codebook = torch.nn.Parameter(torch.ones(6, 2))
        self.candidate_selector.hidden_projection = torch.nn.Linear(4, 2, bias=False)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_codebooks_take_their_own_weight_decay(name):
    """loss.selector.decay: the two codebooks in a third AdamW group with that decay (and a step decays them by
    lr x decay with no gradient); null keeps them in the decayed group, as any matrix, with two groups only."""
    model = Selectorish()
    sel = model.candidate_selector
    cfg = OptimConfig(name=name, lr=LR, weight_decay=0.1)
    adamw = lambda opt: opt.adamw if name == "muon" else opt  # noqa: E731
    groups = adamw(build_optimizer(model, cfg)).param_groups
    assert len(groups) == 2 and {id(sel.predecessor_codebook), id(sel.successor_codebook)} <= {
        id(p) for p in groups[0]["params"]}
    opt = build_optimizer(model, cfg, codebook_decay=0.5)
    groups = adamw(opt).param_groups
    assert len(groups) == 3 and groups[2]["weight_decay"] == 0.5
    assert [id(p) for p in groups[2]["params"]] == [id(sel.predecessor_codebook), id(sel.successor_codebook)]
    assert id(sel.hidden_projection.weight) not in {id(p) for p in groups[2]["params"]}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(sel.successor_codebook, torch.full((6, 2), 1 - LR * 0.5))


# --- optim=muon ------------------------------------------------------------------------------------------------

class Drafterish(torch.nn.Module):
    """The drafter's parameter names: fc (input projection), layers.N.self_attn/mlp matrices, norms."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4, bias=False)
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({
            "self_attn": torch.nn.ModuleDict({"q_proj": torch.nn.Linear(4, 4), "q_norm": torch.nn.LayerNorm(4)}),
            "mlp": torch.nn.ModuleDict({"down_proj": torch.nn.Linear(4, 4, bias=False)})})])
        self.hidden_norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        h = self.fc(x)
        layer = self.layers[0]
        h = layer["self_attn"]["q_norm"](layer["self_attn"]["q_proj"](h))
        return self.hidden_norm(layer["mlp"]["down_proj"](h))


MUON = OptimConfig(name="muon", lr=LR, muon_lr=0.02, weight_decay=0.1, warmup_ratio=0.25, min_lr_ratio=0.1)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = Drafterish()
    opt = build_optimizer(model, MUON)
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    layer = model.layers[0]
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    assert muon == {id(layer["self_attn"]["q_proj"].weight), id(layer["mlp"]["down_proj"].weight)}
    decay, no_decay = opt.adamw.param_groups
    assert {id(p) for p in decay["params"]} == {id(model.fc.weight)}
    assert len(no_decay["params"]) == 5 and all(p.ndim == 1 for p in no_decay["params"])
    assert opt.muon.param_groups[0]["weight_decay"] == 0.1 and opt.muon.param_groups[0]["momentum"] == 0.95
    assert not is_muon_param("fc.weight", model.fc.weight) and not is_muon_param("module.fc.weight", model.fc.weight)


def _steps(model, opt, sched, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(3, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def test_the_schedule_drives_both_learning_rates_also_after_a_state_load():
    model = Drafterish()
    opt = build_optimizer(model, MUON)
    sched = build_scheduler(opt, 8, MUON)
    _steps(model, opt, sched, 2, 0)  # warmup 2 steps: at the peak now
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(LR)
    fresh = build_optimizer(model, MUON)
    fresh_sched = build_scheduler(fresh, 8, MUON)
    fresh.load_state_dict(opt.state_dict())
    fresh_sched.load_state_dict(sched.state_dict())
    _steps(model, fresh, fresh_sched, 6, 1)
    ratio = 0.1  # cosine floor at the last step
    assert fresh.muon.param_groups[0]["lr"] == pytest.approx(0.02 * ratio)
    assert fresh.adamw.param_groups[1]["lr"] == pytest.approx(LR * ratio)


def test_muon_state_round_trips_exactly():
    """Continuing from a loaded state dict gives bit-identical weights to never having stopped."""
    torch.manual_seed(0)
    a = Drafterish()
    b = Drafterish()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = build_optimizer(a, MUON), build_optimizer(b, MUON)
    sch_a, sch_b = build_scheduler(opt_a, 8, MUON), build_scheduler(opt_b, 8, MUON)
    _steps(a, opt_a, sch_a, 3, 0)
    _steps(b, opt_b, sch_b, 3, 0)
    saved, saved_sched = opt_b.state_dict(), sch_b.state_dict()
    opt_c = build_optimizer(b, MUON)
    sch_c = build_scheduler(opt_c, 8, MUON)
    opt_c.load_state_dict(saved)
    sch_c.load_state_dict(saved_sched)
    assert len(opt_c.state) == len(opt_a.state) == 8  # every trainable parameter has state
    _steps(a, opt_a, sch_a, 3, 1)
    _steps(b, opt_c, sch_c, 3, 1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_an_adamw_state_is_refused_by_muon_naming_the_fix():
    model = Drafterish()
    adamw = build_optimizer(model, OptimConfig(lr=LR))
    with pytest.raises(ValueError, match="optim=muon"):
        build_optimizer(model, MUON).load_state_dict(adamw.state_dict())


def test_muon_under_fsdp_is_refused_naming_the_fix():
    check_optimizer(MUON, fsdp=False)
    check_optimizer(OptimConfig(), fsdp=True)
    with pytest.raises(ConfigError, match="optim=muon is not supported with FSDP.*optim=adamw"):
        check_optimizer(MUON, fsdp=True)


def test_adamw_is_fused_on_cuda_and_as_before_elsewhere(monkeypatch):
    """optim.fused=auto: fused where CUDA runs the step (no foreach temporary the size of the parameters at the
    step's peak), torch's default on a CPU (so CPU runs keep their numbers); true and false force it."""
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, OptimConfig()).defaults["fused"] is None
    assert build_optimizer(model, OptimConfig(fused="false")).defaults["fused"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_optimizer(model, OptimConfig()).defaults["fused"] is True
    with pytest.raises(ConfigError, match="optim.fused"):
        OptimConfig(fused="sometimes")
