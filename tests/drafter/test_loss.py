import math

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.loss import block_loss, dpace_weights, label_logits, row_losses, slot_weights, weighted_ce


def test_slot_weights_decay_from_slot_one():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(w[8].item(), math.exp(-1), rel_tol=1e-6)


def test_chunked_loss_and_gradient_equal_the_plain_ones():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=g, requires_grad=True)
    W = torch.randn(1000, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 1000, (300,), generator=g)
    rw = torch.rand(300, generator=g)
    plain, p_pred = weighted_ce(h, W, labels, rw, chunk_logits=0)
    (gh, gW) = torch.autograd.grad(plain, (h, W))
    chunked, c_pred = weighted_ce(h, W, labels, rw, chunk_logits=64 * 1000)  # 64 rows a chunk
    (ch, cW) = torch.autograd.grad(chunked, (h, W))
    assert abs(plain.item() - chunked.item()) < 1e-5 * abs(plain.item())
    assert torch.equal(p_pred, c_pred)
    assert (gh - ch).abs().max() < 1e-5 and (gW - cW).abs().max() < 1e-5


def test_block_loss_is_the_weight_normalised_mean():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 8, generator=g)
    W = torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[:, 0] = False
    mask[2, 3] = False
    loss_sum, weight_sum, pred = block_loss(hidden, W, labels, mask, gamma=2.0)
    w = slot_weights(4, 2.0)
    ce = torch.nn.functional.cross_entropy((hidden @ W.T).view(-1, 50), labels.view(-1), reduction="none").view(3, 4)
    expected = (ce * w * mask).sum() / (w * mask).sum()
    assert torch.allclose(loss_sum / weight_sum, expected, atol=1e-6)
    assert (pred[:, 0] == -1).all() and pred[2, 3] == -1


# --- D-PACE and soft-label (KL) members -------------------------------------------------------------------------

def test_dpace_weights_by_hand():
    """q = [-, 0.5, 1, 0], alpha 0.5: q~ = [1, .75, 1, .5], reach = [.75, .75, .375]; w_j = sum of reach from j."""
    q = torch.tensor([[0.3, 0.5, 1.0, 0.0]])
    mask = torch.tensor([[False, True, True, True]])
    w = dpace_weights(q, mask, alpha=0.5)
    assert torch.allclose(w, torch.tensor([[0.0, 1.875, 1.125, 0.375]]))


def test_dpace_masked_slots_neither_weigh_nor_count():
    """Slot 2 masked: its q (0 here) does not cut the product (q~ = 1) and its term is left out of the sums."""
    q = torch.tensor([[0.3, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[False, True, False, True]])
    w = dpace_weights(q, mask, alpha=0.5)
    assert torch.allclose(w, torch.tensor([[0.0, 0.75 + 0.375, 0.0, 0.375]]))


def test_dpace_with_alpha_one_counts_the_labelled_slots_from_each_slot():
    mask = torch.tensor([[False, True, True, True, False]])
    w = dpace_weights(torch.rand(1, 5), mask, alpha=1.0)
    assert torch.equal(w, torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.0]]))


def _case(seed=1, vocab=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 4, 8, generator=g, requires_grad=True)
    W = torch.randn(vocab, 8, generator=g)
    labels = torch.randint(0, vocab, (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[:, 0] = False
    mask[2, 3] = False
    mask[1, 2] = False
    return hidden, W, labels, mask


def test_dpace_block_loss_weights_are_the_drafters_confidence_without_gradient():
    hidden, W, labels, mask = _case()
    loss_sum, weight_sum, pred = block_loss(hidden, W, labels, mask, gamma=2.0, weighting="dpace", alpha=0.5)
    ce = F.cross_entropy((hidden @ W.T).view(-1, 50), labels.view(-1), reduction="none").view(3, 4)
    w = dpace_weights(torch.exp(-ce.detach()), mask, 0.5)
    assert torch.allclose(loss_sum, (ce * w).sum(), atol=1e-5) and torch.allclose(weight_sum, w.sum())
    assert not weight_sum.requires_grad
    (g,) = torch.autograd.grad(loss_sum, hidden)
    (expected,) = torch.autograd.grad((ce * w).sum(), hidden)  # w a constant: no gradient through the weights
    assert torch.isfinite(g).all() and torch.allclose(g, expected, atol=1e-5)
    assert (pred[:, 0] == -1).all() and pred[2, 3] == -1 and pred[1, 2] == -1


def test_kl_block_loss_by_hand_and_zero_against_itself():
    hidden, W, labels, mask = _case()
    rows = mask.reshape(-1).nonzero().flatten()
    g = torch.Generator().manual_seed(5)
    target = torch.randn(rows.numel(), 50, generator=g)
    loss_sum, weight_sum, _ = block_loss(hidden, W, labels, mask, gamma=2.0, target_logits=target)
    logq = F.log_softmax(hidden.reshape(-1, 8)[rows] @ W.T, -1)
    p = F.softmax(target, -1)
    kl = (p * (p.log() - logq)).sum(-1)
    w = (slot_weights(4, 2.0) * mask).reshape(-1)[rows]
    assert torch.allclose(loss_sum, (kl * w).sum(), atol=1e-5) and torch.allclose(weight_sum, w.sum())
    (grad,) = torch.autograd.grad(loss_sum, hidden)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    own = (hidden.reshape(-1, 8)[rows] @ W.T).detach()
    zero, _, _ = block_loss(hidden, W, labels, mask, gamma=2.0, target_logits=own)
    assert abs(zero.item()) < 1e-5


@pytest.mark.parametrize("member", [{}, {"weighting": "dpace"}, {"weighting": "decay", "kl": True},
                                    {"weighting": "dpace", "kl": True}])
def test_packed_loss_equals_the_one_block_losses(member):
    """Blocks are independent: the packed sums are the sums of each block scored alone."""
    hidden, W, labels, mask = _case(seed=3)
    member = dict(member)
    kl = member.pop("kl", False)
    full = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(9))  # per slot target logits
    rows = mask.reshape(-1).nonzero().flatten()
    extra = {"target_logits": full.reshape(-1, 50)[rows]} if kl else {}
    loss_sum, weight_sum, pred = block_loss(hidden, W, labels, mask, 2.0, **member, **extra)
    parts = []
    for i in range(3):
        m = mask[i:i + 1]
        r = m.reshape(-1).nonzero().flatten()
        one = {"target_logits": full[i].reshape(-1, 50)[r]} if kl else {}
        parts.append(block_loss(hidden[i:i + 1], W, labels[i:i + 1], m, 2.0, **member, **one))
    assert torch.allclose(loss_sum, sum(p[0] for p in parts), atol=1e-5)
    assert torch.allclose(weight_sum, sum(p[1] for p in parts), atol=1e-6)
    assert torch.equal(pred, torch.cat([p[2] for p in parts]))


@pytest.mark.parametrize("kl", [False, True])
def test_chunked_row_losses_and_gradients_equal_the_plain_ones(kl):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=g, requires_grad=True)
    W = torch.randn(1000, 32, generator=g)
    labels = torch.randint(0, 1000, (300,), generator=g)
    target = torch.randn(300, 1000, generator=g) if kl else None
    plain = row_losses(h, W, labels, 0, target)
    chunked = row_losses(h, W, labels, 64 * 1000, target)
    for a, b in zip(plain, chunked):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    (gp,) = torch.autograd.grad(plain[0].sum(), h)
    (gc,) = torch.autograd.grad(chunked[0].sum(), h)
    assert (gp - gc).abs().max() < 1e-5


def test_label_logits_are_the_targets_prediction_of_each_label():
    """Slot k of the block at anchor a is x_{a+k}: the target predicts it at position a+k-1."""
    b, L, V, B = 2, 10, 7, 3
    logits = torch.arange(b * L, dtype=torch.float32)[:, None].repeat(1, V).view(b, L, V)  # value = b*L + pos
    anchors = torch.tensor([[2, 5], [0, 6]])
    mask = torch.ones(b, 2, B, dtype=torch.bool)
    mask[..., 0] = False
    rows = mask.reshape(-1).nonzero().flatten()
    got = label_logits(logits, anchors, rows, B)[:, 0]
    expected = [2, 3, 5, 6, 10, 11, 16, 17]  # positions a+k-1 (k = 1, 2), offset by L for the second sequence
    assert got.tolist() == expected


def _topk_rows(target, k):
    logp = F.log_softmax(target, -1)
    lp, ids = logp.topk(k, -1)
    return lp, ids, (1 - lp.exp().sum(-1)).clamp_min(0)


def test_topk_kl_is_the_full_kl_when_k_is_the_vocabulary_and_the_coarsened_kl_below():
    hidden, W, labels, mask = _case()
    rows = mask.reshape(-1).nonzero().flatten()
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5)) * 3
    full, _, _ = block_loss(hidden, W, labels, mask, gamma=2.0, target_logits=target)
    whole, _, _ = block_loss(hidden, W, labels, mask, gamma=2.0, target_topk=_topk_rows(target, 50))
    assert torch.allclose(whole, full, atol=1e-4)
    (g,) = torch.autograd.grad(whole, hidden)
    assert torch.isfinite(g).all()
    # k = 5: KL of the distributions over (the 5 tokens, everything else), by hand
    lp, ids, rest = _topk_rows(target, 5)
    part, _, _ = block_loss(hidden, W, labels, mask, gamma=2.0, target_topk=(lp, ids, rest))
    q = F.softmax(hidden.reshape(-1, 8)[rows] @ W.T, -1)
    q_top = q.gather(-1, ids)
    q_rest = 1 - q_top.sum(-1)
    kl = (lp.exp() * (lp - q_top.log())).sum(-1) + rest * (rest.log() - q_rest.log())
    w = (slot_weights(4, 2.0) * mask).reshape(-1)[rows]
    assert torch.allclose(part, (kl * w).sum(), atol=1e-4) and part <= full + 1e-5
    (g,) = torch.autograd.grad(part, hidden)
    assert torch.isfinite(g).all()


def test_chunked_topk_kl_equals_the_plain_one():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=g, requires_grad=True)
    W = torch.randn(1000, 32, generator=g)
    labels = torch.randint(0, 1000, (300,), generator=g)
    top = _topk_rows(torch.randn(300, 1000, generator=g), 16)
    plain = row_losses(h, W, labels, 0, None, top)
    chunked = row_losses(h, W, labels, 64 * 1000, None, top)
    assert torch.allclose(plain[0], chunked[0], atol=1e-5)
    (gp,) = torch.autograd.grad(plain[0].sum(), h)
    (gc,) = torch.autograd.grad(chunked[0].sum(), h)
    assert (gp - gc).abs().max() < 1e-5
