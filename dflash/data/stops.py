"""Where generation stops on a stop string (data.completions.stop): one rule for completions and live decoding.

A stop string stops generation at the token that completes it; that token and those before it are kept (the
text may run past the string inside that token). transformers' StopStringCriteria decides it, as `generate`
does while it makes the completions (dflash.data.completions), so live decoding (dflash.drafter.decoding.engine) and the
teacher-forced walk over those completions stop at the same token, also for a string split over several tokens.
"""

from __future__ import annotations

import torch


class StopStrings:
    """The stop strings of a tokenizer's vocabulary: `first` finds where a token sequence stops."""

    def __init__(self, tokenizer, strings) -> None:
        from transformers import StopStringCriteria

        self.strings = list(strings or [])
        # preprocessing the vocabulary takes a while for large ones: built once per tokenizer and strings
        self.criteria = StopStringCriteria(tokenizer, self.strings) if self.strings else None

    def __bool__(self) -> bool:
        return self.criteria is not None

    def hits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """[batch, n - start] bool: whether ids[:, :k + 1] ends on a stop string, for k = start..n-1 (the prompt
        before `start` counts: a string may lie across the prompt's end, as during `generate`)."""
        out = torch.zeros(ids.shape[0], ids.shape[1] - start, dtype=torch.bool, device=ids.device)
        if self.criteria is not None:
            for k in range(start, ids.shape[1]):
                out[:, k - start] = self.criteria(ids[:, : k + 1], None)
        return out

    def first(self, ids: list[int], start: int) -> int | None:
        """The first position k >= start where ids[:k + 1] ends on a stop string (generation keeps ids[:k + 1]), or
        None."""
        if self.criteria is None or start >= len(ids):
            return None
        # the criteria read the last maximum_token_len tokens only: pass that much context, not the whole sequence
        # (plain decoding asks once per token)
        lo = max(0, start + 1 - self.criteria.maximum_token_len)
        hit = self.hits(torch.tensor([ids[lo:]]), start - lo)[0]
        return start + int(hit.nonzero()[0]) if hit.any() else None
