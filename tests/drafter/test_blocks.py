"""Block construction: anchors, labels, and the packed forward against one-block inference."""

import pytest
import torch

from dflash.drafter.blocks import draft_block, draft_packed, eligible_anchors, pack_blocks, sample_anchors
from tests.drafter.test_model import make_drafter

B, MASK = 8, 299


def test_anchors_need_the_next_position_in_the_response():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert eligible_anchors(mask).tolist() == [3, 4, 7]
    assert eligible_anchors(mask, region="all").tolist() == list(range(8))


def test_anchor_sampling_is_seeded_distinct_and_capped():
    mask = torch.ones(100, dtype=torch.bool)
    a = sample_anchors(mask, 10, torch.Generator().manual_seed(0))
    b = sample_anchors(mask, 10, torch.Generator().manual_seed(0))
    c = sample_anchors(mask, 10, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 10 and a.unique().numel() == 10 and torch.equal(a, a.sort().values)
    assert sample_anchors(mask, 500).numel() == 99


def test_labels_are_same_position_and_masked_past_the_end():
    ids = torch.arange(100, 120)[None]
    loss_mask = torch.tensor([[0] * 5 + [1] * 15], dtype=torch.bool)
    blocks = pack_blocks(ids, loss_mask, torch.tensor([20]), [torch.tensor([5, 15])], B, MASK)
    assert blocks.input_ids.view(2, B)[:, 0].tolist() == [105, 115]
    assert (blocks.input_ids.view(2, B)[:, 1:] == MASK).all()
    assert blocks.labels[0, 0].tolist() == list(range(105, 113))  # slot k -> x_{p+k}
    assert blocks.label_mask[0, 0].tolist() == [False] + [True] * 7
    assert blocks.label_mask[0, 1].tolist() == [False] + [True] * 4 + [False] * 3  # past the end
    assert blocks.position_ids[0, 20:28].tolist() == list(range(5, 13))


def _seq(L=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 290, (1, L), generator=g), torch.randn(1, L, 3 * 64, generator=g)


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 6)])
def test_packed_forward_equals_one_block_inference(layer_types, window):
    assert_packed_equals_one_block(make_drafter(layer_types, window), *_seq(), torch.tensor([1, 7, 12, 13, 25, 29]))


def assert_packed_equals_one_block(drafter, ids, feats, anchors):
    """Every block of the packed forward of one sequence (ids [1, 30], feats [1, 30, F]) at `anchors` equals the
    one-block inference forward at its anchor."""
    embed = torch.nn.Embedding(300, 64)
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]), [anchors], B, MASK)
    with torch.no_grad():
        packed = draft_packed(drafter, embed, feats, blocks)
        for j, p in enumerate(anchors.tolist()):
            one = draft_block(drafter, embed, feats[:, :p], ids[:, p], p)
            assert (packed[0, j] - one[0]).abs().max() < 1e-5, p


def test_changes_at_or_after_the_anchor_do_not_reach_the_block():
    """The leakage invariant: features and tokens at positions >= p (other than the block's own
    input x_p) leave block p's output unchanged in the packed training forward."""
    drafter = make_drafter()
    embed = torch.nn.Embedding(300, 64)
    ids, feats = _seq()
    p = 12
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]),
                         [torch.tensor([3, p, 20])], B, MASK)
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[:, p + 1:] = (ids2[:, p + 1:] + 1) % 290
    feats2[:, p:] = torch.randn_like(feats2[:, p:])
    blocks2 = pack_blocks(ids2, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]),
                          [torch.tensor([3, p, 20])], B, MASK)
    with torch.no_grad():
        a = draft_packed(drafter, embed, feats, blocks)
        b = draft_packed(drafter, embed, feats2, blocks2)
        feats3 = feats.clone()
        feats3[:, p - 1] += 1.0  # a change strictly before the anchor must reach it
        c = draft_packed(drafter, embed, feats3, blocks)
    assert torch.equal(a[0, 0], b[0, 0]) and torch.equal(a[0, 1], b[0, 1])
    assert not torch.allclose(a[0, 2], b[0, 2])
    assert not torch.allclose(a[0, 1], c[0, 1])


def test_padded_batch_gives_each_sequence_its_own_result():
    drafter = make_drafter()
    embed = torch.nn.Embedding(300, 64)
    (i1, f1), (i2, f2) = _seq(30, 1), _seq(18, 2)
    ids = torch.zeros(2, 30, dtype=torch.long)
    ids[0], ids[1, :18] = i1[0], i2[0]
    feats = torch.zeros(2, 30, 192)
    feats[0], feats[1, :18] = f1[0], f2[0]
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 18:] = False
    anchors = [torch.tensor([2, 9, 20]), torch.tensor([4])]
    blocks = pack_blocks(ids, mask, torch.tensor([30, 18]), anchors, B, MASK)
    assert blocks.valid.tolist() == [[True] * 3, [True, False, False]]
    with torch.no_grad():
        out = draft_packed(drafter, embed, feats, blocks)
        alone = draft_packed(drafter, embed, f2, pack_blocks(i2, mask[1:, :18], torch.tensor([18]),
                                                             [anchors[1]], B, MASK))
    assert (out[1, 0] - alone[0, 0]).abs().max() < 1e-5
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_flex_attention_path_matches_the_dense_path_on_cpu():
    """The block mask the GPU path compiles, checked on CPU (flex compiles for CPU too)."""
    drafter = make_drafter(["sliding_attention", "full_attention"], 6)
    embed = torch.nn.Embedding(300, 64)
    ids, feats = _seq()
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]),
                         [torch.tensor([1, 7, 12, 13, 25, 29])], B, MASK)
    with torch.no_grad():
        dense = draft_packed(drafter, embed, feats, blocks, "sdpa")
        flex = draft_packed(drafter, embed, feats, blocks, "flex")
    assert (dense - flex).abs().max() < 1e-5


def test_flex_shapes_are_padded_into_buckets():
    from dflash.tiling import FLEX_LENGTH_MULTIPLE as M
    from dflash.tiling import flex_padded_shape

    assert flex_padded_shape(1, 1) == (M, 1)
    assert flex_padded_shape(M, 5) == (M, 8)
    assert flex_padded_shape(M + 1, 300, 512) == (2 * M, 512)
    assert flex_padded_shape(M + 1, 600, 512) == (2 * M, 1024)  # more blocks than usual: a power of two


@pytest.mark.slow
def test_compiled_flex_forward_compiles_once_per_bucket_over_varying_batches(caplog):
    """Twenty-four batches of different lengths and anchor counts through the compiled flex forward
    (CPU, no grad: torch has no flex backward on CPU): one graph per length bucket and mask kind, no
    fallback to uncompiled flex, and the dense path's outputs."""
    import logging
    import warnings

    from torch._dynamo.utils import counters

    from dflash.drafter import attention
    from dflash.tiling import FLEX_LENGTH_MULTIPLE as M
    from dflash.tiling import flex_padded_shape

    torch._dynamo.reset()
    attention._flex_shapes.clear()
    drafter = make_drafter(["sliding_attention", "full_attention"], 6).eval()
    embed = torch.nn.Embedding(300, 64)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 2 * M, (24,), generator=g).tolist()
    graphs_before = counters["stats"]["unique_graphs"]
    buckets = set()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        for i, L in enumerate(lengths):
            ids = torch.randint(0, 290, (1, L), generator=g)
            feats = torch.randn(1, L, 3 * 64, generator=g)
            anchors = sample_anchors(torch.ones(L, dtype=torch.bool), 4 + i % 5, g)
            blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([L]), [anchors], B, MASK)
            buckets.add(flex_padded_shape(L, anchors.numel(), 8))
            dense = draft_packed(drafter, embed, feats, blocks, "sdpa")
            flex = draft_packed(drafter, embed, feats, blocks, "flex", num_blocks=8)
            assert flex.shape == dense.shape
            assert (dense - flex).abs().max() < 1e-5, L
    kinds = 2  # sliding and full attention layers
    assert len(buckets) == 2 and len(set(lengths)) > 20
    assert attention.flex_compile_count() == len(buckets) * kinds
    assert 0 < counters["stats"]["unique_graphs"] - graphs_before <= len(buckets) * kinds
    fallback = [str(w.message) for w in caught if "limit" in str(w.message)]
    fallback += [r.getMessage() for r in caplog.records if "limit" in r.getMessage()]
    assert not fallback


def test_padding_for_flex_leaves_outputs_and_gradients_unchanged():
    """The padding the flex path adds (context to a bucket, blocks to num_anchors), checked on the dense
    path with gradients: real blocks give the same outputs and every parameter the same gradient."""
    from dflash.drafter.blocks import pad_packed

    embed = torch.nn.Embedding(300, 64)
    ids, feats = _seq()
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]),
                         [torch.tensor([1, 7, 12, 25])], B, MASK)
    results = []
    for pad in (False, True):
        drafter = make_drafter(["sliding_attention", "full_attention"], 6).train()
        b, f = pad_packed(blocks, feats, 64, 7, MASK) if pad else (blocks, feats)
        out = draft_packed(drafter, embed, f, b)[:, :4]
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    assert (results[0][0] - results[1][0]).abs().max() < 1e-5
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], atol=1e-6), name


def test_packed_gradients_equal_the_one_block_gradients(monkeypatch):
    """Chunked dense attention (several chunks, context lengths not in order across the batch) gives
    every parameter the gradient of the same blocks drafted one at a time."""
    from dflash.drafter import blocks as blocks_module

    monkeypatch.setattr(blocks_module, "BLOCKS_PER_CHUNK_TOKENS", 2 * B)
    embed = torch.nn.Embedding(300, 64)
    ids, feats = _seq()
    ids, feats = torch.cat([ids, ids.flip(1)]), torch.cat([feats, feats.flip(1)])
    anchors = [torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([20, 24, 27])]
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30, 30]), anchors, B, MASK)
    grads = []
    for packed in (True, False):
        drafter = make_drafter(["sliding_attention", "full_attention"], 6).train()
        if packed:
            out = draft_packed(drafter, embed, feats, blocks)
            loss = sum(out[i, : a.numel()].square().sum() for i, a in enumerate(anchors))
        else:
            loss = sum(draft_block(drafter, embed, feats[i: i + 1, :p], ids[i: i + 1, p], p).square().sum()
                       for i, a in enumerate(anchors) for p in a.tolist())
        loss.backward()
        grads.append({n: p.grad for n, p in drafter.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-4, rtol=1e-4), name


def test_flex_gets_one_dtype_under_autocast(monkeypatch):
    """Autocast casts sdpa's inputs but not flex's: q/k leave the float32-weighted norms in float32 while v
    is bf16, which flex on CUDA refuses; the flex path casts all three to the autocast dtype."""
    from dflash.drafter import attention

    seen = []

    def fake_flex(q, k, v, block_mask, scale, enable_gqa):
        seen.append({q.dtype, k.dtype, v.dtype})
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "_compiled_flex", fake_flex)
    drafter = make_drafter(["sliding_attention", "full_attention"], 6)
    ids, feats = _seq()
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30]), [torch.tensor([1, 7])], B,
                         MASK)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        draft_packed(drafter, torch.nn.Embedding(300, 64), feats, blocks, "flex")
    assert seen == [{torch.bfloat16}] * 2


BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")
# name: (context length, anchors per sequence, block size, sliding window or None, pad for flex, full tiles)
MASK_CASES = {
    "full, one partial tile, block 8": (30, [[1, 7, 12, 13, 25, 28]], 8, None, False, False),
    "full, full tiles, block 16": (300, [list(range(130, 299, 7))], 16, None, False, True),  # q 400, kv 700
    "sliding, window < context": (300, [list(range(0, 299, 12))], 16, 5, False, False),
    "sliding, window across tiles": (300, [list(range(3, 299, 9))], 8, 100, False, False),
    "sliding, window > context": (300, [list(range(130, 299, 7))], 16, 1000, False, True),
    "batch 2 padded for flex, full": (400, [list(range(140, 398, 9)), [5, 60, 140, 300]], 16, None, True, True),
    "batch 2 padded for flex, sliding": (400, [list(range(140, 398, 9)), [5, 60, 140, 300]], 8, 64, True, False),
}


def _mask_case(name):
    """(PackedBlocks, window, expect full tiles) of a MASK_CASES entry; padded as draft_packed pads for flex."""
    from dflash.drafter.blocks import pad_packed
    from dflash.tiling import flex_padded_shape

    L, anchors, block, window, pad, has_full = MASK_CASES[name]
    b = len(anchors)
    ids = torch.randint(0, 290, (b, L), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([L] + [max(a) + 2 for a in anchors[1:]])  # later sequences shorter, right-padded
    blocks = pack_blocks(ids, torch.ones(b, L, dtype=torch.bool), lengths, [torch.tensor(a) for a in anchors],
                         block, MASK)
    if pad:
        blocks, _ = pad_packed(blocks, torch.zeros(b, L, 1), *flex_padded_shape(L, blocks.anchors.shape[1]), MASK)
    return blocks, window, has_full


def _create_block_mask(blocks, window):
    """The BlockMask torch builds from the dense mask: what the flex path used before packed_block_mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.drafter.blocks import make_mask_mod

    (b, n), size, L = blocks.anchors.shape, blocks.block_size, blocks.ctx_len
    mod = make_mask_mod(blocks.anchors, L, size, window)
    return create_block_mask(mod, B=b, H=None, Q_LEN=n * size, KV_LEN=L + n * size, device=blocks.anchors.device)


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_block_mask_equals_the_one_create_block_mask_builds(name):
    """packed_block_mask, built tile by tile from the layout, equals create_block_mask's mask of the same rule:
    the same partial and full tiles in the same order, both ways (q-side for backward), the same mask_mod."""
    from dflash.drafter.blocks import packed_attention_masks

    blocks, window, has_full = _mask_case(name)
    kind = "full_attention" if window is None else "sliding_attention"
    new = packed_attention_masks(blocks, ["sliding_attention", "full_attention"], window, "flex")[kind]
    ref = _create_block_mask(blocks, window)
    for attr in BLOCK_MASK_TENSORS:
        assert torch.equal(getattr(new, attr), getattr(ref, attr)), attr
    assert (new.seq_lengths, new.BLOCK_SIZE) == (ref.seq_lengths, ref.BLOCK_SIZE)
    assert torch.equal(new.to_dense(), ref.to_dense())
    assert new.mask_mod.window == window
    assert (int(new.full_kv_num_blocks.sum()) > 0) == has_full and int(new.kv_num_blocks.sum()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 64])
def test_compiled_flex_gives_the_same_attention_with_either_mask(window):
    """Compiled flex (CPU) skips the tiles a BlockMask leaves out and the mask_mod of full tiles, so a tile
    wrongly left out or marked full changes its output (uncompiled flex reads only mask_mod): with
    packed_block_mask it equals flex with create_block_mask's mask and sdpa with the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.drafter.blocks import make_mask_mod, packed_block_mask

    blocks, _, _ = _mask_case("batch 2 padded for flex, full")
    (b, n), size, L = blocks.anchors.shape, blocks.block_size, blocks.ctx_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 2, n * size, 16, generator=g)
    k, v = torch.randn(2, b, 2, L + n * size, 16, generator=g)
    flex = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        new = flex(q, k, v, block_mask=packed_block_mask(blocks.anchors, L, size, window))
        ref = flex(q, k, v, block_mask=_create_block_mask(blocks, window))
        dense = make_mask_mod(blocks.anchors, L, size, window)(torch.arange(b)[:, None, None, None], 0,
                                                              torch.arange(n * size)[None, None, :, None],
                                                              torch.arange(L + n * size)[None, None, None, :])
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert (new - ref).abs().max() < 1e-5 and (new - sdpa).abs().max() < 1e-5


def test_block_mask_of_a_large_layout_never_builds_the_dense_mask(monkeypatch):
    """512 anchors x 16 on a 3072-token context (the Qwen3.6-27B preset's sequence): create_block_mask held
    20 bytes a [query, key] entry (1.8 GB for the sliding mask); the tile-by-tile build stays under a
    quarter byte an entry, a fraction of even a dense bool mask, and never calls torch's dense builders."""
    import torch.nn.attention.flex_attention as flex_module

    from bench.measure import TensorPeak
    from dflash.drafter.blocks import packed_attention_masks
    from dflash.tiling import FLEX_TILE

    def dense(*args, **kwargs):
        raise AssertionError("the flex mask path built the dense [q, kv] mask")

    monkeypatch.setattr(flex_module, "create_block_mask", dense)
    monkeypatch.setattr(flex_module, "create_mask", dense)
    L, n, size = 3072, 512, 16
    ids = torch.zeros(1, L, dtype=torch.long)
    anchors = torch.linspace(0, L - 2, n).round().long()
    blocks = pack_blocks(ids, torch.ones(1, L, dtype=torch.bool), torch.tensor([L]), [anchors], size, MASK)
    q_len, kv_len = n * size, L + n * size
    with TensorPeak() as mem:
        masks = packed_attention_masks(blocks, ["sliding_attention", "full_attention"], 2048, "flex")
    assert mem.peak < q_len * kv_len / 4, (mem.peak, mem.peak_op)
    tiles = -(-q_len // FLEX_TILE) * -(-kv_len // FLEX_TILE)
    for mask in masks.values():
        assert max(getattr(mask, attr).numel() for attr in BLOCK_MASK_TENSORS) == tiles
        assert int(mask.kv_num_blocks.sum()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_mask_on_cuda_at_the_preset_shape():
    """On CUDA, at 512 anchors x 16 on a 3072-token context: the tile-by-tile mask equals create_block_mask's,
    its build stays under 64 MiB of device memory (the dense build took gigabytes), and compiled flex
    gives the same forward and backward with either mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.drafter.blocks import packed_block_mask

    L, n, size, dev = 3072, 512, 16, torch.device("cuda")
    anchors = torch.linspace(0, L - 2, n).round().long()
    blocks = pack_blocks(torch.zeros(1, L, dtype=torch.long), torch.ones(1, L, dtype=torch.bool), torch.tensor([L]),
                         [anchors], size, MASK).to(dev)
    flex = torch.compile(flex_attention, dynamic=False)
    for window in (None, 2048):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        new = packed_block_mask(blocks.anchors, L, size, window)
        assert torch.cuda.max_memory_allocated() - base < 64 * 2**20
        ref = _create_block_mask(blocks, window)
        for attr in BLOCK_MASK_TENSORS:
            assert torch.equal(getattr(new, attr), getattr(ref, attr)), attr
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, 4, n * size, 64, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 4, L + n * size, 64, device=dev, dtype=torch.bfloat16, generator=g,
                            requires_grad=True) for _ in range(2))
        grads = []
        for mask in (new, ref):
            out = flex(q, k, v, block_mask=mask)
            grads.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        for got, want in zip(*grads):  # the same tiles in the same order: equal up to bf16 accumulation order
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
