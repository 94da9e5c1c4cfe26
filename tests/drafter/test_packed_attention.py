"""The dense path's packed attention (dflash.drafter.packed_attention): the context part by flash attention per
chunk and the own-block part apart, merged by log-sum-exp, equal to one SDPA call over every packed key under
the full mask of make_mask_mod, forward and backward, for each attention rule."""

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.blocks import make_mask_mod, pack_blocks, packed_attention_masks
from dflash.drafter.attention import AttentionRule

B, H, HKV, D = 4, 4, 2, 8


def packed(anchors: list[list[int]], L: int = 30):
    ids = torch.zeros(len(anchors), L, dtype=torch.long)
    lengths = torch.tensor([L] * len(anchors))
    return pack_blocks(ids, torch.ones(len(anchors), L, dtype=torch.bool), lengths,
                       [torch.tensor(a) for a in anchors], B, 0)


def reference(q, k, v, blocks, window, causal):
    """One SDPA call: every query against every packed key, the rule as a dense bool mask."""
    b, n = blocks.anchors.shape
    mod = make_mask_mod(blocks.anchors, blocks.ctx_len, B, window, causal)
    Q, K = n * B, blocks.ctx_len + n * B
    mask = mod(torch.arange(b)[:, None, None, None], 0, torch.arange(Q)[None, None, :, None],
               torch.arange(K)[None, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=True)


RULES = {"full": (None, False), "sliding causal": (6, True), "sliding both ways": (6, False)}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("anchors", [[[0, 3, 9, 17, 25]], [[2, 5, 11, 19, 26], [1, 7, 8]]],
                         ids=["an anchor at 0 (no context)", "two sequences, padding blocks"])
def test_equals_one_sdpa_call_over_every_packed_key(rule, anchors):
    window, causal = RULES[rule]
    blocks = packed(anchors)
    b, n = blocks.anchors.shape
    Q, K = n * B, blocks.ctx_len + n * B
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, D, generator=g, requires_grad=True)
               for h, length in ((H, Q), (HKV, K), (HKV, K)))
    grad = torch.randn(b, H, Q, D, generator=g)
    valid = blocks.valid.repeat_interleave(B, 1)[:, None, :, None]  # a padding block's output is never read
    rule = AttentionRule(causal, window)
    chunked = packed_attention_masks(blocks, [rule], None, "sdpa")[rule]
    for attend in (lambda: chunked.attend(q, k, v, D**-0.5), lambda: chunked._dense(q, k, v, D**-0.5)):
        ours, ref = attend(), reference(q, k, v, blocks, window, causal)
        assert (ours - ref).mul(valid).abs().max() < 1e-5
        gq, gk, gv = torch.autograd.grad(ours, (q, k, v), grad * valid)
        rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad * valid)
        for a, r in ((gq, rq), (gk, rk), (gv, rv)):
            assert (a - r).abs().max() < 1e-5


def test_many_chunks_in_bfloat16_stay_close_to_float32():
    """Four chunks of blocks (BLOCKS_PER_CHUNK_TOKENS queries each), bf16 inputs: within bf16 rounding of the
    float32 result."""
    anchors = [list(range(1, 300, 4))[:64 * 4 // B]]
    blocks = packed(anchors, L=320)
    chunked = packed_attention_masks(blocks, ["full_attention"], None, "sdpa")["full_attention"]
    assert len(chunked.chunks) == 1 + (len(anchors[0]) * B - 1) // 256
    n = blocks.anchors.shape[1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, length, D, generator=g) for h, length in ((H, n * B), (HKV, 320 + n * B),
                                                                           (HKV, 320 + n * B)))
    exact = chunked.attend(q, k, v, D**-0.5)
    half = chunked.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), D**-0.5)
    assert half.dtype == torch.bfloat16 and (half.float() - exact).abs().max() < 3e-2


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("heads", [(4, 2), (6, 2)], ids=["2 query heads a kv head", "3 query heads a kv head"])
def test_many_chunks_backward_equals_one_sdpa_call(rule, heads, monkeypatch):
    """The CPU path over several chunks (each chunk's flash backward adds its context prefix into one key and value
    gradient, its own queries' rows into the query gradient), grouped-query heads, two sequences with padding blocks:
    forward and the gradients of q, k, v equal autograd through one SDPA call over every packed key. Chunks of 1
    block (the first one sees no context: both anchors 0) and of 3, small so the test is; the production chunking
    (one chunk here) beside them."""
    import dflash.drafter.blocks as blocks_module

    window, causal = RULES[rule]
    h, hkv = heads
    anchors = [[0, 2, 3, 5, 9, 12, 17, 18, 20, 26, 27], [0, 1, 4, 8, 9, 15, 22]]
    for per_chunk_tokens, chunks in ((B, 11), (3 * B, 4), (blocks_module.BLOCKS_PER_CHUNK_TOKENS, 1)):
        monkeypatch.setattr(blocks_module, "BLOCKS_PER_CHUNK_TOKENS", per_chunk_tokens)
        blocks = packed(anchors)
        b, n = blocks.anchors.shape
        Q, K = n * B, blocks.ctx_len + n * B
        attention = AttentionRule(causal, window)
        chunked = packed_attention_masks(blocks, [attention], None, "sdpa")[attention]
        assert len(chunked.chunks) == chunks and (chunks != 11 or chunked.chunks[0].ctx_len == 0)
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(b, heads_, length, D, generator=g, requires_grad=True)
                   for heads_, length in ((h, Q), (hkv, K), (hkv, K)))
        grad = torch.randn(b, h, Q, D, generator=g)
        valid = blocks.valid.repeat_interleave(B, 1)[:, None, :, None]  # a padding block's output is never read
        ours, ref = chunked.attend(q, k, v, D**-0.5), reference(q, k, v, blocks, window, causal)
        assert (ours - ref).mul(valid).abs().max() < 1e-5
        got = torch.autograd.grad(ours, (q, k, v), grad * valid)
        want = torch.autograd.grad(ref, (q, k, v), grad * valid)
        for name, a, r in zip("qkv", got, want):
            assert torch.isfinite(a).all(), name
            assert (a - r).abs().max() < 1e-5, (name, per_chunk_tokens, (a - r).abs().max().item())
