"""Errors are for people: one base class, and entry points that print its message, not a traceback.

(evaluate.py's version of the entry-point check is in test_config.py.)
"""

import inspect
import os
import subprocess
import sys

from dflash import errors
from tests.conftest import REPO

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]


def test_every_dflash_error_subclasses_the_base_and_a_builtin_exception():
    assert len(CLASSES) >= 10 and errors.DFlashError in CLASSES
    for cls in CLASSES:
        assert issubclass(cls, errors.DFlashError), cls.__name__
        if cls is not errors.DFlashError:
            # so `except ValueError` (FileNotFoundError, ...) in user code keeps working
            builtin = {b for b in cls.__mro__ if b.__module__ == "builtins"} - {Exception, BaseException, object}
            assert builtin, f"{cls.__name__} derives from no built-in exception but Exception"


def test_report_of_a_missing_run_prints_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-m", "dflash.report", "runs=[nope]", f"root={tmp_path}"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1 and "no run 'nope'" in out and str(tmp_path) in out
    assert list(tmp_path.iterdir()) == []  # nothing written for a report that could not be made
