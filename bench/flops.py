"""`bench.flops` is dflash.plan.flops under its old name, for a while (the model FLOPs moved with the plan)."""
import sys

import dflash.plan.flops

sys.modules[__name__] = dflash.plan.flops
