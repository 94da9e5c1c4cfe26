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


def _explained() -> tuple[type, ...]:
    """Errors whose message already names the thing and the fix: shown without a traceback."""
    from dflash.cache import CacheError
    from dflash.checkpoint import CheckpointError
    from dflash.completions import CompletionsError
    from dflash.live import LosslessError
    from dflash.provenance import ProvenanceError
    from dflash.training import TrainingError

    return (ConfigError, CacheError, CheckpointError, CompletionsError, LosslessError, ProvenanceError,
            TrainingError, FileNotFoundError)


def run(fn, job: JobConfig):
    """fn(job); an explained error exits with its message (set DFLASH_TRACEBACK=1 for the trace)."""
    try:
        return fn(job)
    except Exception as e:
        if not os.environ.get("DFLASH_TRACEBACK") and isinstance(e, _explained()):
            fail(e)
        raise
