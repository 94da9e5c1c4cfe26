"""Shared start-up of the Hydra entry points: typed config, logging, clean config errors."""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf

from dflash.config import ConfigError, JobConfig

log = logging.getLogger("dflash")


def to_job(cfg: DictConfig) -> JobConfig:
    """DictConfig -> JobConfig, running every __post_init__ check; a bad value exits with its message."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError as e:
        fail(e)
    except Exception as e:  # omegaconf wraps errors raised inside __post_init__
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            fail(cause)
        raise


def fail(error: Exception) -> None:
    log.error("%s", error)
    sys.exit(2)
