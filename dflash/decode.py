"""For users' scripts: live speculative decoding is the room dflash.drafter.decoding (its engine module).

    from dflash.decode import speculative_generate
"""

from dflash.drafter.decoding.engine import SpecResult, greedy_generate, speculative_generate

__all__ = ["SpecResult", "greedy_generate", "speculative_generate"]
