"""A drafter that knows the answer: for tests of decoding and evaluation."""

import torch

from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDraftModel


class OracleDrafter(DFlashDraftModel):
    """Slot k of the block at anchor p proposes truth[p + k]; `wrong(p, k)` marks deliberate misses.

    The hidden state is the target's lm_head row of the wanted token, scaled up, so that the
    target's head maps it back to that token (checked by `check_head`).
    """

    def __init__(self, target, truth: list[int], block_size=8, wrong=None, layer_ids=(1, 3), scale: float = 50.0,
                 selector_scale: float | None = None):
        """selector_scale: a DFlash 2 oracle, its selector's codebooks this many times their init (large enough,
        the pairwise scores overrule the unary ones now and then: its path is not the argmax path)."""
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

    def check_head(self) -> bool:
        logits = self.head @ self.head.T
        return bool((logits.argmax(-1) == torch.arange(self.head.shape[0])).all())

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
        return self.head[tokens] * self.scale
