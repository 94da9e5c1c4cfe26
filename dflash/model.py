"""Kept for users' scripts: the drafter lives in dflash.drafter.model.

    from dflash.model import DFlashDrafter   # == dflash.drafter.model.DFlashDraftModel
"""

from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDrafter, DFlashDraftModel

__all__ = ["DFlashDraftModel", "DFlashDrafter", "drafter_config"]
