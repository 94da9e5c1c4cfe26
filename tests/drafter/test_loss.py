import math

import torch

from dflash.drafter.loss import block_loss, slot_weights, weighted_ce


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
