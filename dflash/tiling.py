"""How packed training blocks are laid out for the attention kernels: plain numbers and shape arithmetic that the
drafter's block construction (dflash.drafter.blocks) runs with and the memory plan (dflash.plan.memory) counts
with, kept below both so that the plan's pure model imports nothing of the drafter."""

from __future__ import annotations

FLEX_TILE = 128
"""Side of a BlockMask tile (flex attention's default BLOCK_SIZE): the mask lists, per tile of 128
queries, the tiles of 128 keys holding a visible entry, and apart those where every entry is visible."""

BLOCKS_PER_CHUNK_TOKENS = 256
"""The sdpa path's queries per chunk of blocks: fewer waste keys, more calls; 256 measured best on CPU."""

FLEX_LENGTH_MULTIPLE = 256
"""flex attention is compiled for static shapes: context lengths are padded to a multiple of this, so a
run compiles at most max_length / 256 graphs per mask kind instead of one per batch."""


def flex_padded_shape(ctx_len: int, n_blocks: int, num_blocks: int | None = None) -> tuple[int, int]:
    """(context length, block count) a packed batch is padded to on the flex path: the context to a
    multiple of FLEX_LENGTH_MULTIPLE, the blocks to `num_blocks` (train.num_anchors) or a power of two."""
    length = -(-ctx_len // FLEX_LENGTH_MULTIPLE) * FLEX_LENGTH_MULTIPLE
    blocks = num_blocks if num_blocks is not None and num_blocks >= n_blocks else 1 << max(n_blocks - 1, 0).bit_length()
    return length, blocks
