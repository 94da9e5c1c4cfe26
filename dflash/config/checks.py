"""The checks the config dataclasses run in __post_init__ (at OmegaConf.to_object time)."""

from __future__ import annotations

import logging

from dflash.errors import ConfigError  # the one dflash import of dflash.config: a leaf module of exceptions

__all__ = ["ConfigError", "enum_value", "one_of", "positive"]

log = logging.getLogger("dflash.config")


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {sorted(allowed)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def enum_value(key: str, value, allowed: tuple[str, ...], old: dict[str, str]) -> str:
    """A string enum's value: one of `allowed`, or an old spelling (`old`: its text, as OmegaConf stores a bool in a
    str field, "True"/"False", to the new value) taken with a one-line deprecation note; anything else is refused
    naming the key."""
    text = str(value)
    if text in allowed:
        return text
    new = old.get(text) or old.get(text.lower())
    if new is None:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {', '.join(allowed)}")
    quoted = f' (in YAML quoted, "{new}": unquoted, off and on are booleans)' if new in ("off", "on") else ""
    log.warning("%s=%s is deprecated: write %s=%s%s", key, text.lower(), key, new, quoted)
    return new
