"""Shared start-up of the Hydra entry points: typed config, logging, errors people can act on."""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf

from dflash.config.renamed import refuse_renamed
from dflash.dist import finish
from dflash.errors import ConfigError, DFlashError
from dflash.layout import COMPILE_CACHES, compile_cache_dirs
from dflash.provenance import check_allowed

log = logging.getLogger("dflash")


def to_job(cfg: DictConfig):
    """DictConfig -> its dataclass (JobConfig, ReportConfig), running every __post_init__ check;
    a bad value exits with its message."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from omegaconf.errors import MissingMandatoryValue

    try:
        job = OmegaConf.to_object(cfg)
    except ConfigError as e:
        fail(e)
    except MissingMandatoryValue as e:
        fail(ConfigError(f"{e.full_key} is required and has no value; set it on the command line, e.g. "
                         f"{e.full_key}={'/path/prompts.jsonl' if e.full_key.endswith('prompts') else '...'}"))
    except Exception as e:  # omegaconf wraps errors raised inside __post_init__
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            fail(cause)
        raise
    if hasattr(job, "run"):
        use_compile_caches(job.run.compile_cache)
    if hasattr(job, "provenance"):
        try:
            check_allowed(job.provenance.allow_mismatch)
        except ConfigError as e:
            fail(e)
    return job


def use_compile_caches(folder: str | None = None) -> dict[str, str]:
    """Point Triton's and TorchInductor's caches (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR) at `folder`'s triton/
    and inductor/ (run.compile_cache; None = $DFLASH_HOME/compile-cache), where the user has not exported them:
    later runs and the other processes of a launch then find the kernels compiled and autotuned. Both libraries
    read the variables when they first compile, so this runs as the entry points start. Returns the two in effect."""
    for var, path in compile_cache_dirs(folder).items():
        if not os.environ.get(var):
            os.environ[var] = str(path)
    return {var: os.environ[var] for var in COMPILE_CACHES}


def refuse_moved_keys(argv: list[str] | None = None) -> None:
    """Stop, in one line naming the new key, at a command-line key that moved into a sub-group (eval.temperature is
    eval.decode.temperature: dflash.config.renamed). Runs before Hydra parses, which would only say the old key is
    not in the config."""
    try:
        refuse_renamed(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(e)


def names_target(overrides: list[str]) -> bool:
    """Whether command-line overrides choose the target (target=, target.*=, experiment=, debug=): otherwise
    evaluate.py takes the one the checkpoint's run was trained with."""
    keys = (o.lstrip("+~").split("=", 1)[0] for o in overrides)
    return any(k in ("target", "experiment", "debug") or k.startswith(("target.", "target/")) for k in keys)


def fail(error: Exception) -> None:
    log.error("%s", error)
    sys.exit(2)


def run(fn, job):
    """fn(job), then the launch's process groups ended cleanly (dflash.dist.finish); a DFlashError exits 2 with its
    message alone (set DFLASH_TRACEBACK=1 for the trace)."""
    try:
        out = fn(job)
        finish()
        return out
    except DFlashError as e:
        if os.environ.get("DFLASH_TRACEBACK"):
            raise
        fail(e)
