"""Kept for users' scripts: live speculative decoding lives in dflash.evaluate.decode.

    from dflash.decode import speculative_generate
"""

from dflash.evaluate.decode import SpecResult, greedy_generate, speculative_generate

__all__ = ["SpecResult", "greedy_generate", "speculative_generate"]
