"""The config groups a plan reads, composed as train.py composes them (report.py and costs.py both read them; a
module of its own, so neither imports the other for it)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import SearchPathException
from omegaconf import OmegaConf

from dflash.config import refuse_renamed, register_configs
from dflash.config.data import storage_for

CONF = Path(__file__).resolve().parents[2] / "conf"
"""The shipped config tree, train.py's config_path."""


def compose(overrides: list[str], config_dir: str | None = None, config_name: str = "train") -> dict:
    """The config groups a plan reads, composed from conf/<config_name>.yaml like train.py does. config_dir: a
    folder of the user's own configs (their target/<name>.yaml, say) searched beside conf/, as train.py's
    --config-dir adds it to Hydra's search path."""
    refuse_renamed(overrides)  # a key that moved into a sub-group: one line naming the new one
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # restores Hydra's global state after
        if config_dir is not None:
            search_with(config_dir)
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    # group by group: the data group may lack what only a real run needs (data.prompts)
    job = {k: OmegaConf.to_object(cfg[k]) for k in ("target", "drafter", "layers", "loss", "noise", "train", "optim")}
    d = cfg.data
    data = {"prompts": None if OmegaConf.is_missing(d, "prompts") else d.prompts, "format": d.format,
            "split": d.split, "limit": d.limit, "offset": d.offset}
    storage = storage_for(cfg.features.storage, job["target"].dtype)  # auto: as extraction resolves it
    return {**job, "max_length": d.max_length, "data": data, "storage": storage}


def search_with(config_dir: str) -> None:
    """Search `config_dir` beside conf/ exactly as train.py's --config-dir does (hydra._internal.utils._run_hydra):
    after conf/, before the registered schemas, so that it adds configs (its target/mine.yaml, a primary config of
    its own for config_name) and a file of the same name in conf/ wins. Hydra has no public call for this: an
    override hydra.searchpath=[...] is read only after the primary config is found, so --config-name could not name
    one of the folder's."""
    where = Path(config_dir).expanduser().resolve()
    if not where.is_dir():  # Hydra's own words for train.py's --config-dir
        raise SearchPathException(f"Additional config directory '{where}' not found")
    path = create_config_search_path(str(CONF))
    path.prepend(provider="command-line", path=f"file://{where}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name="app", config_search_path=path)
