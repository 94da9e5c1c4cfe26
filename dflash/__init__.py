"""Train and evaluate DFlash block-diffusion drafters (distribution dflash-train; import name dflash).

The z-lab reference decoder's wheel (distribution dflash) installs `import dflash` too: importing this
package warns once when that one is installed beside it (dflash/_owner.py, docs/reference_decoder.md).
"""

from dflash import _owner

_owner.warn_if_shared()
