"""The config groups a plan reads, composed as train.py composes them (report.py and costs.py both read them; a
module of its own, so neither imports the other for it)."""

from __future__ import annotations

from pathlib import Path


def compose(overrides: list[str]) -> dict:
    """The config groups a plan reads, composed from conf/train.yaml like train.py does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from dflash.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=overrides)
    # group by group: the data group may lack what only a real run needs (data.prompts)
    job = {k: OmegaConf.to_object(cfg[k]) for k in ("target", "drafter", "layers", "loss", "noise", "train", "optim")}
    d = cfg.data
    data = {"prompts": None if OmegaConf.is_missing(d, "prompts") else d.prompts, "format": d.format,
            "split": d.split, "limit": d.limit, "offset": d.offset}
    return {**job, "max_length": d.max_length, "data": data, "storage": cfg.features.storage}
