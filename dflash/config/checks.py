"""The checks the config dataclasses run in __post_init__ (at OmegaConf.to_object time)."""

from __future__ import annotations

from dflash.errors import ConfigError  # the one dflash import of dflash.config: a leaf module of exceptions

__all__ = ["ConfigError", "one_of", "positive"]


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {sorted(allowed)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
