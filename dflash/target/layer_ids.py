"""Which target layers feed the drafter: the reference formula and its validation (DESIGN §2)."""

from __future__ import annotations

from dflash.config import LayersConfig
from dflash.errors import ConfigError


def build_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Reference layer choice: `round(1 + i*(T-4)/(n-1))`, spread between layer 1 and T-3."""
    if num_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_layers - 1)) for i in range(num_layers)]


def resolve_layer_ids(cfg: LayersConfig, num_target_layers: int) -> list[int]:
    """The target layer ids a drafter reads, validated against the target's depth."""
    ids = list(cfg.ids) if cfg.ids is not None else build_target_layer_ids(num_target_layers, cfg.num)
    source = "layers.ids" if cfg.ids is not None else f"the reference formula with layers.num={cfg.num}"
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source} gives repeated layer ids {ids} for a {num_target_layers}-layer target; "
                          f"lower layers.num or list layers.ids explicitly")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ConfigError(f"layer ids {bad} from {source} are outside [0, {num_target_layers}) "
                          f"for this {num_target_layers}-layer target")
    if num_target_layers - 1 in ids and not cfg.allow_last_layer:
        raise ConfigError(
            f"layer {num_target_layers - 1} is the target's last layer: its output is what the logits are "
            f"made from, so a drafter fed with it trains well and serves badly. Pick earlier layers, or "
            f"set layers.allow_last_layer=true if you mean it")
    return ids
