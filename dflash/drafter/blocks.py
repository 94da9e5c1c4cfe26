"""Block construction: anchors, packed training blocks, their attention rule, and the drafter
forward for many blocks at once (training, teacher-forced evaluation) or one block (decoding).

One block at anchor p (B = block size): input tokens [x_p, M, ..., M] at positions
p..p+B-1, context = target features of positions < p, slot k predicts x_{p+k}. Packing puts
all blocks of a sequence after its full context in one forward; the attention rule below lets
block b see context positions < anchor_b and its own B tokens, never another block, which is
exactly what the one-block forward sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # pragma: no cover
    create_block_mask = None


def eligible_anchors(loss_mask: torch.Tensor, region: str = "response") -> torch.Tensor:
    """Positions p that may anchor a block: p and p+1 in the response (region=all: any p < L-1).

    loss_mask: [L] bool. Returns sorted positions [n].
    """
    if region == "all":
        return torch.arange(max(loss_mask.shape[0] - 1, 0))
    ok = loss_mask[:-1] & loss_mask[1:]
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `num_anchors` distinct eligible anchors, sorted; all of them when fewer exist."""
    pos = eligible_anchors(loss_mask)
    if pos.numel() > num_anchors:
        pick = torch.randperm(pos.numel(), generator=generator)[:num_anchors]
        pos = pos[pick].sort().values
    return pos


@dataclass
class PackedBlocks:
    """Many blocks of a padded batch of sequences, ready for one drafter forward.

    anchors/valid: [b, n]; input_ids: [b, n*B]; position_ids: [b, L + n*B] (context then
    blocks); labels/label_mask: [b, n, B] (slot 0 never counts); ctx_len: padded L.
    """

    anchors: torch.Tensor
    valid: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    ctx_len: int
    block_size: int

    def to(self, device) -> PackedBlocks:
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()}
        return PackedBlocks(**moved)


def pack_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: list[torch.Tensor],
    block_size: int,
    mask_token_id: int,
) -> PackedBlocks:
    """Build packed blocks for a right-padded batch.

    input_ids/loss_mask: [b, L]; lengths: [b]; anchors: per sequence, sorted positions.
    Labels at slot k are x_{p+k}; they count only inside the sequence and the response.
    """
    b, L = input_ids.shape
    n = max(1, max((a.numel() for a in anchors), default=1))
    anchor = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, a in enumerate(anchors):
        anchor[i, : a.numel()] = a
        valid[i, : a.numel()] = True
    slots = torch.arange(block_size)
    pos = anchor[:, :, None] + slots  # [b, n, B]
    inside = (pos < lengths[:, None, None]) & valid[:, :, None]
    gather = pos.clamp(max=L - 1)
    labels = torch.gather(input_ids, 1, gather.view(b, -1)).view(b, n, block_size)
    in_response = torch.gather(loss_mask, 1, gather.view(b, -1)).view(b, n, block_size)
    label_mask = inside & in_response.bool()
    label_mask[:, :, 0] = False
    block_in = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype)
    block_in[:, :, 0] = torch.gather(input_ids, 1, anchor)
    position_ids = torch.cat([torch.arange(L).expand(b, L), pos.view(b, -1)], dim=1)
    return PackedBlocks(anchor, valid, block_in.view(b, -1), position_ids, labels, label_mask, L, block_size)


def make_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None):
    """The packed attention rule as a flex-attention mask_mod(b, h, q_idx, kv_idx) -> bool.

    Query q_idx belongs to block q_idx // B (anchor a, position a + q_idx % B). Key kv_idx < ctx_len
    is context position kv_idx, visible when kv_idx < a; other keys are block tokens, visible only
    within the query's own block. Sliding layers see only keys at positions q-(window-1) .. q (causal
    inside the block, DESIGN §2).
    The dense SDPA mask is this same function evaluated on a broadcast grid.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        anchor = anchors[b, blk]
        is_ctx = kv_idx < ctx_len
        visible = (is_ctx & (kv_idx < anchor)) | (~is_ctx & ((kv_idx - ctx_len) // block_size == blk))
        if window is not None:  # by position: causal, the `window` keys ending at the query (DESIGN §2)
            k_pos = torch.where(is_ctx, kv_idx, anchor + (kv_idx - ctx_len) % block_size)
            dist = anchor + q_idx % block_size - k_pos
            visible = visible & (dist >= 0) & (dist < window)
        return visible

    mask_mod.window = window  # the mask kind, part of what a compiled flex graph is specialised on
    return mask_mod


@dataclass
class Chunk:
    """Queries [q_start, q_end) attend to context keys [0, ctx_len) and the keys of their own
    blocks; `mask` [b, 1, q, ctx_len + q] is the packed rule restricted to those keys."""

    q_start: int
    q_end: int
    ctx_len: int
    mask: torch.Tensor


@dataclass
class ChunkedMask:
    """The dense (SDPA) form of the packed rule, split into chunks of blocks sorted by anchor.

    Dense attention over all packed keys spends most of its work on masked entries: every
    block would score every other block's tokens and the whole context. A chunk of blocks
    needs only the context up to its largest anchor and its own block tokens, so the same
    result costs a fraction of the work and memory.
    """

    chunks: list[Chunk]
    ctx_len: int
    """Packed context length: keys [0, ctx_len) are context, the rest are block tokens."""


BLOCKS_PER_CHUNK_TOKENS = 256  # queries per chunk: fewer waste keys, more calls; 256 measured best on CPU


def packed_attention_masks(blocks: PackedBlocks, layer_types: list[str], window: int | None,
                           backend: str) -> dict:
    """Per-layer-type masks for the packed forward: a ChunkedMask (sdpa) or a BlockMask (flex)."""
    b, n = blocks.anchors.shape
    B, L = blocks.block_size, blocks.ctx_len
    q_len = n * B
    dev = blocks.anchors.device
    masks = {}
    for kind in sorted(set(layer_types)):
        mod = make_mask_mod(blocks.anchors, L, B, window if kind == "sliding_attention" else None)
        if backend == "flex":
            masks[kind] = create_block_mask(mod, B=b, H=None, Q_LEN=q_len, KV_LEN=L + q_len, device=dev)
            continue
        per_chunk = max(1, BLOCKS_PER_CHUNK_TOKENS // B)
        chunks = []
        for first in range(0, n, per_chunk):
            last = min(n, first + per_chunk)
            ctx = int(blocks.anchors[:, first:last].max()) if blocks.valid[:, first:last].any() else 0
            q_idx = torch.arange(first * B, last * B, device=dev)
            kv_idx = torch.cat([torch.arange(ctx, device=dev), L + q_idx])
            mask = mod(torch.arange(b, device=dev)[:, None, None, None], 0, q_idx[None, None, :, None],
                       kv_idx[None, None, None, :])
            chunks.append(Chunk(first * B, last * B, ctx, mask))
        masks[kind] = ChunkedMask(chunks, L)
    return masks


FLEX_LENGTH_MULTIPLE = 256
"""flex attention is compiled for static shapes: context lengths are padded to a multiple of this, so a
run compiles at most max_length / 256 graphs per mask kind instead of one per batch."""


def flex_padded_shape(ctx_len: int, n_blocks: int, num_blocks: int | None = None) -> tuple[int, int]:
    """(context length, block count) a packed batch is padded to on the flex path: the context to a
    multiple of FLEX_LENGTH_MULTIPLE, the blocks to `num_blocks` (train.num_anchors) or a power of two."""
    length = -(-ctx_len // FLEX_LENGTH_MULTIPLE) * FLEX_LENGTH_MULTIPLE
    blocks = num_blocks if num_blocks is not None and num_blocks >= n_blocks else 1 << max(n_blocks - 1, 0).bit_length()
    return length, blocks


def pad_packed(blocks: PackedBlocks, features: torch.Tensor, ctx_len: int, n_blocks: int,
               mask_token_id: int) -> tuple[PackedBlocks, torch.Tensor]:
    """Blocks and features padded to `ctx_len` context positions and `n_blocks` blocks.

    Padded context positions lie at or after every real anchor, so no real block sees them; padded
    blocks (anchor 0, invalid, no labels) see only their own tokens. Real blocks' outputs are unchanged.
    """
    b, n = blocks.anchors.shape
    B, L, dev = blocks.block_size, blocks.ctx_len, blocks.anchors.device
    extra = n_blocks - n
    anchors = torch.cat([blocks.anchors, blocks.anchors.new_zeros(b, extra)], 1)
    valid = torch.cat([blocks.valid, blocks.valid.new_zeros(b, extra)], 1)
    input_ids = torch.cat([blocks.input_ids, blocks.input_ids.new_full((b, extra * B), mask_token_id)], 1)
    block_pos = torch.cat([blocks.position_ids[:, L:], torch.arange(B, device=dev).repeat(extra).expand(b, -1)], 1)
    position_ids = torch.cat([torch.arange(ctx_len, device=dev).expand(b, -1), block_pos], 1)
    labels = torch.cat([blocks.labels, blocks.labels.new_zeros(b, extra, B)], 1)
    label_mask = torch.cat([blocks.label_mask, blocks.label_mask.new_zeros(b, extra, B)], 1)
    features = torch.nn.functional.pad(features, (0, 0, 0, ctx_len - features.shape[1]))
    return PackedBlocks(anchors, valid, input_ids, position_ids, labels, label_mask, ctx_len, B), features


def draft_packed(drafter, embed_tokens, features: torch.Tensor, blocks: PackedBlocks,
                 backend: str = "sdpa", model=None, num_blocks: int | None = None) -> torch.Tensor:
    """Drafter hidden states for every packed block: [b, n, B, H].

    features: [b, L, n_layers * H] (already noised if noise is on). model: what to call
    (a DDP/compiled wrapper of `drafter`); defaults to the drafter itself. With backend=flex the
    forward runs on shapes padded by `flex_padded_shape` (num_blocks: the usual block count, e.g.
    train.num_anchors), so compiled graphs are reused across batches; the result is the same.
    """
    b, n = blocks.anchors.shape
    if backend == "flex":
        ctx_len, n_padded = flex_padded_shape(blocks.ctx_len, n, num_blocks)
        if (ctx_len, n_padded) != (blocks.ctx_len, n):
            blocks, features = pad_packed(blocks, features, ctx_len, n_padded, drafter.mask_token_id)
    masks = packed_attention_masks(blocks, drafter.layer_types, drafter.config.sliding_window, backend)
    noise = embed_tokens(blocks.input_ids).to(features.dtype)
    hidden = (drafter if model is None else model)(noise, features, blocks.position_ids, attention_mask=masks)
    return hidden.view(b, -1, blocks.block_size, hidden.shape[-1])[:, :n]


def draft_block(drafter, embed_tokens, features: torch.Tensor, anchor_token: torch.Tensor, anchor: int,
                cache=None) -> torch.Tensor:
    """Drafter hidden states for one block at `anchor` (inference): [b, B, H].

    features: [b, c, n_layers * H], the context positions not yet in `cache` (all positions
    < anchor when there is no cache). anchor_token: [b] the last committed token x_p.
    """
    b, c = features.shape[:2]
    size = drafter.block_size
    tokens = torch.full((b, size), drafter.mask_token_id, dtype=torch.long, device=features.device)
    tokens[:, 0] = anchor_token
    start = anchor - c
    positions = torch.arange(start, anchor + size, device=features.device).expand(b, -1)
    return drafter(embed_tokens(tokens).to(features.dtype), features, positions, cache=cache)
