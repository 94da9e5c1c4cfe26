"""The optimizer (AdamW, or Muon + AdamW) and the learning-rate schedule: transformers' warmup + cosine (with
a floor) or constant."""

from __future__ import annotations

import math

import torch

from dflash.config import OptimConfig
from dflash.errors import ConfigError


def warmup_steps(total_steps: int, cfg: OptimConfig) -> int:
    return int(math.ceil(cfg.warmup_ratio * total_steps))


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon's share (optim=muon): the hidden 2-D matrices of the decoder layers (attention and MLP
    projections). Not `fc`, the input projection of the concatenated target features (Muon's convention
    leaves input and output maps, like embeddings and heads, to AdamW; the embeddings and LM head here are
    the frozen target's anyway), nor norms and biases (not matrices), nor DFlash 2's selector codebooks
    (embedding tables, [vocab, rank])."""
    return p.ndim == 2 and "norm" not in name and "fc" not in name.split(".") and "codebook" not in name


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether AdamW decays the weight: matrices, not norms, biases or DFlash 2's static convolution taps (per
    channel scales that start at the identity: decay would pull it to zero)."""
    return p.ndim >= 2 and "norm" not in name and "base_kernel" not in name


def use_fused(cfg: OptimConfig) -> bool | None:
    """AdamW's `fused` argument for optim.fused: auto is fused where CUDA runs the step (the parameters move there
    after the optimizer is built), else torch's default (None: foreach on CUDA, a loop elsewhere)."""
    setting = str(cfg.fused).lower()
    if setting == "auto":
        return True if torch.cuda.is_available() else None
    return setting == "true"


def check_optimizer(cfg: OptimConfig, fsdp: bool) -> None:
    """optim=muon runs under DDP (or one process) only: FSDP shards the matrices Muon orthogonalises whole,
    and its optimizer checkpoints expect one torch optimizer's state layout, not MuonAdamW's."""
    if cfg.name == "muon" and fsdp:
        raise ConfigError("optim=muon is not supported with FSDP (it shards the matrices Muon orthogonalises, "
                          "and its checkpoints expect one torch optimizer's state); train with DDP, or use "
                          "optim=adamw")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                    codebook_decay: float | None = None) -> torch.optim.Optimizer:
    """AdamW (norms, biases and convolution taps get no weight decay, `decays`), or with optim.name=muon
    torch.optim.Muon on the hidden matrices (`is_muon_param`) and AdamW on the rest, as one optimizer
    (`MuonAdamW`). codebook_decay: DFlash 2's selector codebooks in a third AdamW group with this weight decay
    (loss.selector.decay); None = in the decayed group, as any matrix (and no third group: older optimizer
    states still load)."""
    decay, no_decay, codebooks, muon = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if cfg.name == "muon" and is_muon_param(name, p):
            muon.append(p)
        elif codebook_decay is not None and "codebook" in name:
            codebooks.append(p)
        else:
            (decay if decays(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if codebooks:
        groups.append({"params": codebooks, "weight_decay": codebook_decay})
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=use_fused(cfg))
    if cfg.name != "muon":
        return adamw
    if not muon:
        raise ValueError("optim=muon found no hidden 2-D weights to give Muon; use optim=adamw")
    adjust = None if cfg.muon_adjust_lr == "original" else cfg.muon_adjust_lr
    inner = torch.optim.Muon([{"params": muon, "weight_decay": cfg.weight_decay}], lr=cfg.muon_lr,
                             momentum=cfg.muon_momentum, adjust_lr_fn=adjust)
    return MuonAdamW(inner, adamw)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer, so accelerate prepares, saves and restores one object and one
    LR scheduler drives both.

    param_groups are the two inner optimizers' own group dicts (Muon's first), so a scheduler setting
    group["lr"] (from each group's initial_lr) reaches them; state_dict is {"muon": ..., "adamw": ...} and
    load_state_dict restores each exactly (what an AdamW alone round-trips).
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        # Optimizer.__init__ registers these very dicts (add_param_group keeps the dict it is given)
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})

    @property
    def state(self):
        """The inner optimizers' per-parameter state, merged (read-only view; their params are disjoint)."""
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, _value) -> None:  # Optimizer.__init__ assigns an empty state: the inner ones hold it
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"optimizer state has keys {sorted(state_dict)}: not a Muon + AdamW checkpoint "
                             "(optim=muon); resume with the optimizer it was trained with")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # loading gives the inner optimizers new group dicts: share them again, for the scheduler
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    """Linear warmup from 0 over warmup_ratio of the steps, then cosine decay to min_lr_ratio x lr
    at `total_steps` (or constant). Stepped once per optimizer step."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = warmup_steps(total_steps, cfg)
    if cfg.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps, min_lr_rate=cfg.min_lr_ratio)
