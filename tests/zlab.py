"""The z-lab reference decoder (`dflash` 0.1.0 `model.py`), imported under another name as a test oracle.

`make test` unpacks the wheel into <venv>/zlab-dflash-0.1.0 (never installed: it is also `import dflash`).
Set DFLASH_ZLAB_MODEL to another copy of its model.py to use that one.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

DEFAULT = Path(sys.prefix) / "zlab-dflash-0.1.0" / "dflash" / "model.py"


def reference():
    """The reference model module (DFlashDraftModel, DFlash2DraftModel, dflash_generate, ...)."""
    path = Path(os.environ.get("DFLASH_ZLAB_MODEL", DEFAULT))
    if not path.exists():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"{path}: the z-lab reference is missing; `make test` unpacks it there")
        pytest.skip(f"z-lab reference model.py not at {path} (make test unpacks it; or set DFLASH_ZLAB_MODEL)")
    if "zlab_dflash_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["zlab_dflash_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["zlab_dflash_model"]
