"""A drafter that knows the answer: for tests of decoding and evaluation."""

import torch

from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDraftModel


class OracleDrafter(DFlashDraftModel):
    """Slot k of the block at anchor p proposes truth[p + k]; `wrong(p, k)` marks deliberate misses.

    The hidden state is the target's lm_head row of the wanted token, scaled up, so that the
    target's head maps it back to that token (checked by `check_head`), or the row `rows` gives
    for it (a real model's tied embedding: `own_rows`).
    """

    def __init__(self, target, truth: list[int], block_size=8, wrong=None, layer_ids=(1, 3), scale: float = 50.0,
                 selector_scale: float | None = None, rows: dict[int, torch.Tensor] | None = None):
        """selector_scale: a DFlash 2 oracle, its selector's codebooks this many times their init (large enough,
        the pairwise scores overrule the unary ones now and then: its path is not the argmax path).
        rows: {token: hidden state [H]} used instead of those tokens' head rows (before `scale`)."""
        keys = None if selector_scale is None else {"conv_kernel_size": 2, "conv_group_size": 16,
                                                    "selector_rank": 16, "selector_top_k": 4}
        config = drafter_config(target.config, num_layers=1, block_size=block_size, target_layer_ids=list(layer_ids),
                                mask_token_id=target.mask_token_id, dflash2=keys)
        super().__init__(config)
        if selector_scale is not None:
            torch.manual_seed(0)
            with torch.no_grad():
                for p in self.candidate_selector.parameters():
                    p.normal_(0.0, selector_scale)
        self.truth, self.wrong = list(truth), wrong or (lambda p, k: False)
        self.head = target.lm_head.weight.detach().float()
        self.scale = scale  # larger: the drafted distributions are sharper (argmax unchanged)
        self.rows = dict(rows or {})

    def check_head(self, tokens: list[int] | None = None) -> bool:
        """Whether the head maps each token's hidden state back to it: every token's, or those of `tokens`."""
        ids = torch.arange(self.head.shape[0]) if tokens is None else torch.tensor(sorted(set(tokens)))
        logits = self.hidden(ids) @ self.head.T
        return bool((logits.argmax(-1) == ids).all())

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.head[tokens]
        for t, row in self.rows.items():
            out[tokens == t] = row
        return out

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None, cache=None):
        q = noise_embedding.shape[1]
        pos = position_ids[:, -q:]
        if cache is not None:
            new = position_ids[:, : target_hidden.shape[1]]
            cache.positions = new if cache.positions is None else torch.cat([cache.positions, new], 1)
        tokens = torch.zeros_like(pos)
        for b in range(pos.shape[0]):
            for j in range(q):
                p = int(pos[b, j])
                anchor, k = p - j % self.block_size, j % self.block_size
                t = self.truth[p] if p < len(self.truth) else 0
                tokens[b, j] = (t + 1) % self.head.shape[0] if k and self.wrong(anchor, k) else t
        return self.hidden(tokens) * self.scale


def own_rows(head: torch.Tensor, tokens: list[int], steps: int = 100) -> dict[int, torch.Tensor]:
    """{token: hidden state [H]} that the head [V, H] maps to that token, its logit above every other one's by
    exactly 1: for a real model's tied embedding, whose rows share a large common direction, so that a row is
    often not its own argmax (SmolLM2-135M: 44,116 of 49,152 rows). Found by the perceptron's updates from the
    centred rows (a few steps), then divided by the margin."""
    head, ids = head.float(), torch.tensor(sorted(set(tokens)))
    h, out = head[ids] - head.mean(0), {}
    for _ in range(steps):
        logits = h @ head.T  # [tokens, V]
        rows = torch.arange(len(ids))
        own = logits[rows, ids]
        logits[rows, ids] = float("-inf")
        best, other = logits.max(-1)
        margin = own - best
        done = margin > 0
        out.update({int(t): row for t, row in zip(ids[done], h[done] / margin[done, None])})
        ids, h = ids[~done], h[~done] + head[ids[~done]] - head[other[~done]]
        if not len(ids):
            return out
    raise AssertionError(f"no hidden state found in {steps} steps that the head maps back to {ids.tolist()} (a "
                         f"row equal to another token's has none: SmolLM2's unused special tokens share theirs)")
