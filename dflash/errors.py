"""One error base for everything dflash explains to a person, subclassed per area.

An entry point catches `DFlashError` and prints its message (no traceback): the message already
names the key, file or field, what was expected and how to fix it. Each class also derives from
the built-in exception a caller would expect (ValueError for bad values, FileNotFoundError for a
missing path, ...), so `except ValueError` in user code keeps working.
"""

from __future__ import annotations


class DFlashError(Exception):
    """Bad input or state that a person can fix; the message says what and how."""


class ConfigError(DFlashError, ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


class NotFoundError(DFlashError, FileNotFoundError):
    """A path, run, prompt set or model that was asked for does not exist."""


class TargetError(DFlashError, RuntimeError):
    """The target cannot be loaded as configured (e.g. fallback kernels on CUDA)."""


class DataError(DFlashError, ValueError):
    """Prompts or training sequences are unusable (malformed records, nothing left to train on)."""


class CompletionsError(DFlashError, RuntimeError):
    """Completions could not be obtained; the message says from where and what to do."""


class CacheError(DFlashError, RuntimeError):
    """A feature cache is missing, incomplete, corrupt or belongs to another configuration."""


class ProvenanceError(DFlashError, RuntimeError):
    """Features do not match what the checkpoint was trained on."""


class CheckpointError(DFlashError, RuntimeError):
    """A checkpoint cannot be found, read or written; the message says which and what to do."""


class TrainingError(DFlashError, RuntimeError):
    """Training cannot continue; the message names the step, the batch and what to do."""


class DistributedError(DFlashError, RuntimeError):
    """The processes of a launch cannot go on together: one failed, fell silent or never arrived."""


class LosslessError(DFlashError, AssertionError):
    """Speculative decoding produced a different output than plain decoding of the target."""
