"""`bench.plan` is dflash.plan under its old name, for a while: the plan moved to the library (`python -m dflash.plan`)."""
import sys

import dflash.plan

if __name__ == "__main__":
    dflash.plan.main()
else:  # the same module object: what `from bench import plan` reads or patches is dflash.plan's
    sys.modules[__name__] = dflash.plan
