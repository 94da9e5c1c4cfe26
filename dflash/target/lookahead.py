"""Two build steps for the toy target (dflash/target/toy.py) that make its middle layers read more like
a large target's: growing a trained build deeper, and a lookahead objective on the last layer a drafter
reads.

Why: a drafter is fed the outputs of target layers 1..T-3 (the reference formula). The 8-layer toy
target formed its next token only in its last layer, which a drafter may not read: linear probes of
layers 5 and 6 found the token after next 17% of the time at answer positions, layer 7 found the next
one 97% of the time. Grown to 12 layers, the formula reads layers 1, 3, 5, 7 and 9, layer 7 included;
the lookahead heads (as multi-token prediction trains a model to predict more than its next token) then
teach layer 9 to carry tokens 2, 3 and 4 ahead. The heads are a training device and are not saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.target.layer_ids import build_target_layer_ids


def layer_pattern(config, num_layers: int) -> list[str]:
    """`config.layer_types` continued to `num_layers` layers with its period (Qwen3.5: 3 Gated DeltaNet
    layers, then 1 full-attention layer)."""
    types = list(config.layer_types)
    period = types.index("full_attention") + 1
    if any(t != types[i % period] for i, t in enumerate(types)):
        raise ValueError(f"layer_types {types} do not repeat with period {period}; cannot continue them")
    return [types[i % period] for i in range(num_layers)]


def deepen(model, num_layers: int):
    """A copy of the Qwen3.5 hybrid `model` with layers appended up to `num_layers`, their types continuing
    its pattern. The new layers' output projections (attention and MLP) start at zero, so the deeper
    model computes exactly what `model` does until it is trained."""
    from transformers import Qwen3_5ForCausalLM

    old = model.config.num_hidden_layers
    if num_layers <= old:
        raise ValueError(f"deepen to {num_layers} layers: the model already has {old}")
    config = model.config.__class__.from_dict(
        {**model.config.to_dict(), "num_hidden_layers": num_layers, "layer_types": layer_pattern(model.config,
                                                                                                  num_layers)})
    deeper = Qwen3_5ForCausalLM(config).to(model.dtype)
    missing, unexpected = deeper.load_state_dict(model.state_dict(), strict=False)
    new_layer = tuple(f"model.layers.{i}." for i in range(old, num_layers))
    if unexpected or any(not k.startswith(new_layer) for k in missing):
        raise ValueError(f"deepen: weights do not carry over (missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for layer in deeper.model.layers[old:]:
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            mixer.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    deeper.generation_config = model.generation_config
    return deeper


def shifted_labels(labels: torch.Tensor, ahead: int) -> torch.Tensor:
    """Labels for predicting, at each position q, the token at q+ahead: `labels` ([b, L], the token at each
    position or -100, unshifted as transformers takes them) moved left by `ahead`, -100 where none is left."""
    out = torch.full_like(labels, -100)
    out[:, :-ahead] = labels[:, ahead:]
    return out


class LookaheadHeads(nn.Module):
    """One small residual MLP per offset k: from a layer's output at position q, logits (through the
    target's own output embedding) for the token at q+k."""

    def __init__(self, hidden_size: int, offsets: tuple[int, ...], eps: float = 1e-6):
        super().__init__()
        if not offsets or min(offsets) < 1:
            raise ValueError(f"lookahead offsets must be >= 1, got {offsets}")
        self.offsets = tuple(offsets)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.SiLU(),
                                                nn.Linear(hidden_size, hidden_size)) for _ in offsets)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=eps) for _ in offsets)
        self.caught: dict[str, torch.Tensor] = {}

    @classmethod
    def attach(cls, model, offsets: tuple[int, ...]) -> LookaheadHeads:
        """Heads that read the last of the 5 layers a drafter reads from `model` (the reference formula),
        caught by a forward hook at each forward of `model`; `heads.loss(labels, output_embedding)` after it."""
        heads = cls(model.config.hidden_size, offsets, model.config.rms_norm_eps)
        heads.layer = build_target_layer_ids(model.config.num_hidden_layers, 5)[-1]
        model.model.layers[heads.layer].register_forward_hook(
            lambda _m, _i, out: heads.caught.update(hidden=out[0] if isinstance(out, tuple) else out))
        return heads

    def loss(self, labels: torch.Tensor, lm_head: torch.Tensor) -> list[torch.Tensor]:
        """`forward` on what the attached model's last forward left in the read layer."""
        return self(self.caught["hidden"], labels, lm_head)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor) -> list[torch.Tensor]:
        """Mean cross-entropy per offset, over the positions whose token `k` ahead has a label."""
        losses = []
        for k, mlp, norm in zip(self.offsets, self.mlps, self.norms):
            logits = F.linear(norm(hidden + mlp(hidden)), lm_head)
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), shifted_labels(labels, k).flatten(),
                                          ignore_index=-100))
        return losses
