"""The packed blocks' attention on the dense (SDPA) path: each query attends to the context its block may see and to
its own block, the two parts computed apart and merged by their log-sum-exps.

A packed query of block j (anchor a_j) sees context keys [0, a_j) (windowed and causal as the layer's rule says)
and the B keys of block j, never another block. The chunked form before this one attended each chunk of blocks to
the context up to its last anchor plus all the chunk's block keys (a mask hiding the other blocks): at 512 anchors
on a 544-token context about half of what the kernel scored was masked. Here:
- context: per chunk of blocks (sorted by anchor), CPU flash attention (`_scaled_dot_product_flash_attention_for
  _cpu`) of the chunk's queries against the context prefix [0, its largest anchor), with an additive mask for the
  per-block limits, which returns its log-sum-exp;
- own block: for all blocks at once, the [B, B] scores of each block against its own keys, explicitly;
- merged: o = e^(lse_ctx - lse) o_ctx + e^(lse_blk - lse) o_blk, lse = logaddexp(lse_ctx, lse_blk).
Backward is exact without differentiating a log-sum-exp: flash attention's backward computes its keys' share of the
gradient from the final output and log-sum-exp (P = exp(S - lse), D = rowsum(dO * O)), so it is called per chunk
with the merged ones, and the own-block share is written out the same way. No key or value is copied per chunk
(prefix views), and the key gradient is one buffer each chunk adds its prefix into.

Elsewhere than on a CPU (train.attention=sdpa on CUDA), each chunk goes through F.scaled_dot_product_attention
with the dense mask rebuilt from the two parts, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass
class Chunk:
    """Queries [q_start, q_end) (whole blocks), their context keys [0, ctx_len): `context_mask` [b, 1, q, ctx_len]
    additive (0 visible, -inf hidden, float32), `context_empty` [b, 1, q] where a query sees no context key."""

    q_start: int
    q_end: int
    ctx_len: int
    context_mask: torch.Tensor | None
    context_empty: torch.Tensor | None


@dataclass
class ChunkedMask:
    """The packed rule for the dense path: the context part in chunks of blocks, the own-block part for all blocks.

    block_mask: [b, 1, n, B, B] bool, query slot i of block j sees key slot k of block j."""

    chunks: list[Chunk]
    ctx_len: int
    """Packed context length: keys [0, ctx_len) are context, the rest are block tokens."""
    block_size: int
    block_mask: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [b, h, n B, d], k and v [b, h_kv, ctx_len + n B, d] (grouped-query heads as SDPA's enable_gqa) ->
        [b, h, n B, d]."""
        if q.device.type != "cpu":
            return self._dense(q, k, v, scale)
        device = q.device.type
        # as autocast casts SDPA's inputs (rotary leaves q and k in float32, v is the projection's bf16), then
        # the parts run in that dtype with float32 softmax statistics, autocast off
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        with torch.autocast(device, enabled=False):
            return _SplitAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), self, scale)

    def _dense(self, q, k, v, scale):
        B, L, outs = self.block_size, self.ctx_len, []
        for ch in self.chunks:
            first, last = ch.q_start // B, ch.q_end // B
            own = self.block_mask[:, :, first:last]  # [b, 1, m, B, B] -> the chunk's block-diagonal [b, 1, q, q]
            m = own.shape[2]
            diag = torch.zeros(own.shape[0], 1, m, B, m, B, dtype=torch.bool, device=own.device)
            diag[:, :, torch.arange(m), :, torch.arange(m)] = own.permute(2, 0, 1, 3, 4)
            mask = diag.reshape(own.shape[0], 1, m * B, m * B)
            keys, vals = k[:, :, L + ch.q_start:L + ch.q_end], v[:, :, L + ch.q_start:L + ch.q_end]
            if ch.ctx_len:
                mask = torch.cat([ch.context_mask == 0, mask], -1)
                keys = torch.cat([k[:, :, :ch.ctx_len], keys], 2)
                vals = torch.cat([v[:, :, :ch.ctx_len], vals], 2)
            outs.append(F.scaled_dot_product_attention(q[:, :, ch.q_start:ch.q_end], keys, vals, attn_mask=mask,
                                                       scale=scale, enable_gqa=True))
        return torch.cat(outs, 2)


def chunked_mask(mask_mod, anchors: torch.Tensor, ctx_len: int, block_size: int, per_chunk: int) -> ChunkedMask:
    """The ChunkedMask of `mask_mod` (dflash.drafter.blocks.make_mask_mod's rule) for packed blocks at `anchors`
    [b, n], `per_chunk` blocks a chunk: each chunk's context keys end at its largest anchor."""
    b, n = anchors.shape
    B, dev = block_size, anchors.device
    bi = torch.arange(b, device=dev)
    chunks = []
    for first in range(0, n, per_chunk):
        last = min(n, first + per_chunk)
        ctx = int(anchors[:, first:last].max())
        q_idx = torch.arange(first * B, last * B, device=dev)
        if ctx:
            seen = mask_mod(bi[:, None, None, None], 0, q_idx[None, None, :, None],
                            torch.arange(ctx, device=dev)[None, None, None, :])
            additive = torch.zeros(seen.shape, device=dev).masked_fill_(~seen, NEG_INF)
            chunks.append(Chunk(first * B, last * B, ctx, additive, ~seen.any(-1)))
        else:
            chunks.append(Chunk(first * B, last * B, 0, None, None))
    slot = torch.arange(B, device=dev)
    blk = torch.arange(n, device=dev)[:, None, None]
    own = mask_mod(bi[:, None, None, None, None], 0, (blk * B + slot[:, None])[None, None],
                   (ctx_len + blk * B + slot[None, :])[None, None])
    return ChunkedMask(chunks, ctx_len, B, own)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _own_block_scores(q, k, mask: ChunkedMask, scale: float) -> torch.Tensor:
    """[b, h_kv, g, n, B, B] float32 scores of each block's queries against its own keys, hidden ones -inf."""
    qb, kb = _query_blocks(q, k.shape[1], mask.block_size), _own_keys(k, mask)
    # not scaled in place: the product is a matmul's output, which selective checkpointing keeps from the forward
    # for its replay (dflash.drafter.recompute); masked in place: the scaled copy is this function's own
    s = (qb @ kb.transpose(-1, -2)).float() * scale
    return s.masked_fill_(~mask.block_mask[:, :, None], NEG_INF)


def _query_blocks(t: torch.Tensor, hkv: int, B: int) -> torch.Tensor:
    """[b, h, n B, .] per query -> [b, h_kv, g, n, B, .]: each key-value head's g query heads, block by block."""
    t = t.unflatten(1, (hkv, -1))
    return t.unflatten(-2, (t.shape[-2] // B, B))


def _own_keys(t: torch.Tensor, mask: ChunkedMask) -> torch.Tensor:
    """[b, h_kv, ctx_len + n B, d] keys or values -> the blocks' own ones, [b, h_kv, 1, n, B, d]."""
    t = t[:, :, mask.ctx_len:]
    return t.unflatten(-2, (t.shape[-2] // mask.block_size, mask.block_size))[:, :, None]


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: ChunkedMask, scale: float):
        b, h, Q, d = q.shape
        s = _own_block_scores(q, k, mask, scale)
        lse_blk = torch.logsumexp(s, -1)  # [b, h_kv, g, n, B]
        p = torch.exp(s - lse_blk[..., None]).to(v.dtype)
        out_blk = (p @ _own_keys(v, mask)).reshape(b, h, Q, d)
        lse_blk = lse_blk.reshape(b, h, Q)
        parts, lses = [], []
        for ch in mask.chunks:
            if not ch.ctx_len:
                parts.append(q.new_zeros(b, h, ch.q_end - ch.q_start, d))
                lses.append(q.new_full((b, h, ch.q_end - ch.q_start), NEG_INF, dtype=torch.float32))
                continue
            o, lse = _FLASH(q[:, :, ch.q_start:ch.q_end], k[:, :, :ch.ctx_len], v[:, :, :ch.ctx_len],
                            attn_mask=ch.context_mask.to(q.dtype), scale=scale)
            parts.append(o)
            lses.append(lse.float().masked_fill(ch.context_empty, NEG_INF))  # flash gives 0 for a row with no key
        out_ctx, lse_ctx = torch.cat(parts, 2), torch.cat(lses, 2)
        lse = torch.logaddexp(lse_ctx, lse_blk)
        out = (torch.exp(lse_ctx - lse)[..., None] * out_ctx + torch.exp(lse_blk - lse)[..., None] * out_blk)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        b, h, Q, d = q.shape
        hkv, L, B = k.shape[1], mask.ctx_len, mask.block_size
        grad = grad.to(q.dtype).contiguous()
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_q = []
        for ch in mask.chunks:
            rows = slice(ch.q_start, ch.q_end)
            if not ch.ctx_len:
                grad_q.append(q.new_zeros(b, h, ch.q_end - ch.q_start, d))
                continue
            dq, dk, dv = _FLASH_BACKWARD(grad[:, :, rows], q[:, :, rows], k[:, :, :ch.ctx_len], v[:, :, :ch.ctx_len],
                                         out[:, :, rows], lse[:, :, rows].contiguous(), 0.0, False,
                                         attn_mask=ch.context_mask.to(q.dtype), scale=scale)
            grad_q.append(dq)
            grad_k[:, :, :ch.ctx_len] += dk
            grad_v[:, :, :ch.ctx_len] += dv
        grad_q = torch.cat(grad_q, 2)
        # the own block's share, as flash's backward computes a part's from the merged output and log-sum-exp
        g = lambda t: _query_blocks(t, hkv, B)  # noqa: E731
        p = torch.exp(_own_block_scores(q, k, mask, scale) - g(lse[..., None]))  # [b, h_kv, g, n, B, B]
        go = g(grad).float()
        vb = _own_keys(v, mask).float()
        ds = p * (go @ vb.transpose(-1, -2) - (go * g(out).float()).sum(-1, keepdim=True)) * scale
        kb = _own_keys(k, mask).float()
        grad_q = grad_q + (ds @ kb).reshape(b, h, Q, d).to(grad_q.dtype)
        qb = g(q).float()
        grad_k[:, :, L:] = (ds.transpose(-1, -2) @ qb).sum(2).reshape(b, hkv, Q, d).to(k.dtype)
        grad_v[:, :, L:] = (p.transpose(-1, -2) @ go).sum(2).reshape(b, hkv, Q, d).to(v.dtype)
        return grad_q, grad_k, grad_v, None, None
