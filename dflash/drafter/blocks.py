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

from dflash.drafter.packed_attention import chunked_mask
from dflash.tiling import BLOCKS_PER_CHUNK_TOKENS, FLEX_TILE, flex_padded_shape

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None


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


def make_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None,
                  causal: bool | None = None):
    """The packed attention rule as a flex-attention mask_mod(b, h, q_idx, kv_idx) -> bool.

    Query q_idx belongs to block q_idx // B (anchor a, position a + q_idx % B). Key kv_idx < ctx_len
    is context position kv_idx, visible when kv_idx < a; other keys are block tokens, visible only
    within the query's own block. A causal layer sees only keys at positions <= the query's; a window W
    keeps the keys within W positions of the query: q-(W-1) .. q when causal (DESIGN §2's sliding rule),
    |q - k| < W both ways when not (DFlash 2's non-causal sliding layers, as vLLM serves them).
    causal: None = causal exactly when there is a window (the DFlash sliding_attention default).
    The dense SDPA mask is this same function evaluated on a broadcast grid.
    """
    causal = window is not None if causal is None else causal

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        anchor = anchors[b, blk]
        is_ctx = kv_idx < ctx_len
        visible = (is_ctx & (kv_idx < anchor)) | (~is_ctx & ((kv_idx - ctx_len) // block_size == blk))
        if causal or window is not None:  # by position (DESIGN §2)
            k_pos = torch.where(is_ctx, kv_idx, anchor + (kv_idx - ctx_len) % block_size)
            dist = anchor + q_idx % block_size - k_pos
            if causal:
                visible = visible & (dist >= 0)
            if window is not None:
                visible = visible & (dist < window) & (dist > -window)
        return visible

    mask_mod.window = window  # the mask kind, part of what a compiled flex graph is specialised on
    mask_mod.causal = causal
    return mask_mod


def _visible_spans(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None,
                   causal: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys make_mask_mod lets each packed query see, as two intervals [start, end) of key indices:
    its context (positions < anchor, within the window on sliding layers) and its own block's keys (up to the
    query when causal, within the window when there is one).

    anchors: [b, n]. Returns [(start, end)] * 2, each [b, n*B] int32.
    """
    b, n = anchors.shape
    dev = anchors.device
    slot = torch.arange(block_size, device=dev)
    anchor = anchors[:, :, None].expand(b, n, block_size)  # [b, n, B]: each query's anchor
    own = ctx_len + torch.arange(n, device=dev)[:, None] * block_size  # [n, 1]: key of the block's slot 0
    ctx_end = anchor.clamp(0, ctx_len)
    if window is None:  # every context position < anchor
        ctx_start, own_start = torch.zeros_like(ctx_end), own
    else:  # the keys within `window` positions of the query (anchor + slot)
        ctx_start = (anchor + slot - (window - 1)).clamp(min=0)
        own_start = own + (slot - (window - 1)).clamp(min=0)
    if causal:
        own_end = own + slot + 1
    else:
        own_end = own + (slot + window).clamp(max=block_size) if window is not None else own + block_size
    flat = lambda t: t.expand(b, n, block_size).reshape(b, -1).to(torch.int32)
    return [(flat(ctx_start), flat(ctx_end)), (flat(own_start), flat(own_end))]


def _tile_counts(spans: list[tuple[torch.Tensor, torch.Tensor]], kv_len: int, tile: int) -> torch.Tensor:
    """Visible entries of every (query tile, key tile): [b, q_tiles, kv_tiles] int32.

    spans: disjoint key intervals per query, each [b, q]. The largest temporary is [b, q, kv_tiles],
    1/tile of the dense [q, kv] mask.
    """
    q_len = spans[0][0].shape[1]
    pad = -q_len % tile  # queries past q_len see nothing, as in create_block_mask's padding
    kv_tiles = -(-kv_len // tile)
    edges = (torch.arange(kv_tiles + 1, device=spans[0][0].device, dtype=torch.int32) * tile).clamp(max=kv_len)
    lo, hi = edges[:-1], edges[1:]
    count = None
    for start, end in spans:
        start, end = (torch.nn.functional.pad(t, (0, pad))[..., None] for t in (start, end))
        part = (torch.minimum(end, hi) - torch.maximum(start, lo)).clamp(min=0)
        count = part if count is None else count + part
    b, q, _ = count.shape
    return count.view(b, q // tile, tile, kv_tiles).sum(2, dtype=torch.int32)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, q_tiles, kv_tiles] bool -> BlockMask's (num_blocks [b, 1, q_tiles], indices [b, 1, q_tiles,
    kv_tiles]) int32: each row's listed tiles first, ascending, as create_block_mask orders them."""
    tiles = tiles[:, None].to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32)


def packed_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None,
                      tile: int = FLEX_TILE, *, causal: bool | None = None) -> BlockMask:
    """The flex BlockMask of the packed rule, built from the layout tile by tile.

    create_block_mask evaluates `mask_mod` on the whole [q, kv] grid first (3 to 20 bytes an entry:
    gigabytes at 512 anchors and a 3k context); here each query's visible keys are two intervals, so
    the visible entries per tile follow from interval overlaps. Tiles with every entry visible are
    listed as full (flex skips mask_mod there), the rest with any visible entry as partial (mask_mod
    decides each entry), and the same tensors in the same order as create_block_mask's come out.
    anchors: [b, n]; window: the sliding layers' (None: full attention); causal: as make_mask_mod. Nothing is [q, kv]: the mask's
    int32 tensors are at most [b, 1, q_tiles, kv_tiles], the largest temporary [b, q, kv_tiles]; nothing
    is read back to the host.
    """
    q_len = anchors.shape[1] * block_size
    mask_mod = make_mask_mod(anchors, ctx_len, block_size, window, causal)
    spans = _visible_spans(anchors, ctx_len, block_size, window, mask_mod.causal)
    count = _tile_counts(spans, ctx_len + q_len, tile)
    full = count == tile * tile
    return BlockMask.from_kv_blocks(*_ordered((count > 0) & ~full), *_ordered(full), BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(q_len, ctx_len + q_len))


def packed_attention_masks(blocks: PackedBlocks, kinds: list, window: int | None, backend: str) -> dict:
    """Masks for the packed forward, one per kind of layer: a ChunkedMask (sdpa: dflash.drafter.packed_attention)
    or a BlockMask (flex).

    kinds: the layers' attention rules (dflash.drafter.attention.AttentionRule: causal, window; `window` unused), or
    their layer types (full_attention; sliding_attention: causal with `window`). Keyed as given."""
    B, L = blocks.block_size, blocks.ctx_len
    masks = {}
    for kind in dict.fromkeys(kinds):
        if isinstance(kind, str):
            kind_window, causal = (window, True) if kind == "sliding_attention" else (None, False)
        else:
            kind_window, causal = kind.window, kind.causal
        if backend == "flex":
            masks[kind] = packed_block_mask(blocks.anchors, L, B, kind_window, causal=causal)
            continue
        mod = make_mask_mod(blocks.anchors, L, B, kind_window, causal)
        masks[kind] = chunked_mask(mod, blocks.anchors * blocks.valid, L, B, max(1, BLOCKS_PER_CHUNK_TOKENS // B))
    return masks


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

    Block tokens are rows of the target's table `embed_tokens.weight` with the target's embedding scale
    (`drafter.scales`, as servers embed them: the table, not the target's embedding module).
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
    masks = packed_attention_masks(blocks, drafter.attention_rules, None, backend)
    noise = drafter.scales.embed(embed_tokens.weight, blocks.input_ids).to(features.dtype)
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
    noise = drafter.scales.embed(embed_tokens.weight, tokens).to(features.dtype)
    return drafter(noise, features, positions, cache=cache)
