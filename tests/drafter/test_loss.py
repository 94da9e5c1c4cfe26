import math

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.dflash2 import CandidateSelector
from dflash.drafter.loss import (block_loss, block_terms, dpace_weights, expected_rejections, label_logits,
                                 label_rows, log_acceptance, log_acceptance_topk, row_losses, slot_weights,
                                 weighted_ce)


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
                                    {"weighting": "dpace", "kl": True}, {"objective": "tv", "kl": True},
                                    {"objective": "nla", "weighting": "dpace", "kl": True},
                                    {"objective": "expected_tau", "kl": True, "temperature": 0.7}])
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


# --- the acceptance objectives: tv, nla, expected_tau ------------------------------------------------------------

ACCEPTANCE = ["tv", "nla", "expected_tau"]


def _alpha_by_hand(drafter_logits, target_logits, temperature=1.0):
    """1 - TV(p, q) = 1 - sum_x |p(x) - q(x)| / 2, the two distributions at temperature T."""
    p = F.softmax(target_logits / temperature, -1)
    q = F.softmax(drafter_logits / temperature, -1)
    return 1 - 0.5 * (p - q).abs().sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_acceptance_is_one_minus_the_total_variation(temperature):
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(6, 30, generator=g) * 2, torch.randn(6, 30, generator=g) * 2
    alpha = log_acceptance(logits, target, temperature).exp()
    assert torch.allclose(alpha, _alpha_by_hand(logits, target, temperature), atol=1e-6)
    assert ((alpha > 0) & (alpha <= 1)).all()
    if temperature != 1:  # the temperature is applied, to both
        assert (alpha - log_acceptance(logits, target).exp()).abs().min() > 1e-4
    # the caller's log-probabilities (T = 1) give the same
    assert torch.allclose(log_acceptance(logits, target, temperature, F.log_softmax(logits, -1)).exp(), alpha)


def test_acceptance_losses_by_hand_on_a_tiny_example():
    """B = 4, three blocks; block 1 has a masked slot in the middle (slot 2), block 2 its last slot masked."""
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5)) * 2
    q_logits = hidden.reshape(-1, 8)[rows] @ W.T
    alpha = _alpha_by_hand(q_logits, target)
    w = (slot_weights(4, 2.0) * mask).reshape(-1)[rows]
    for objective, row in (("tv", 1 - alpha), ("nla", -alpha.log())):
        loss_sum, weight_sum, _ = block_loss(hidden, W, labels, mask, 2.0, target_logits=target, objective=objective)
        assert torch.allclose(loss_sum, (row * w).sum(), atol=1e-5) and torch.allclose(weight_sum, w.sum())
    # expected_tau: per block, the labelled slots minus sum_k prod_{j<=k} alpha_j, a masked slot's alpha = 0
    per_slot = torch.zeros(3, 4)
    per_slot.view(-1)[rows] = alpha.detach()
    expected = 0.0
    for b in range(3):
        reach, accepted = 1.0, 0.0
        for k in range(1, 4):
            reach *= per_slot[b, k].item() if mask[b, k] else 0.0
            accepted += reach
        expected += mask[b].sum().item() - accepted
    loss_sum, weight_sum, _ = block_loss(hidden, W, labels, mask, 2.0, target_logits=target, objective="expected_tau")
    assert loss_sum.item() == pytest.approx(expected, abs=1e-5) and weight_sum.item() == 3  # blocks with a label
    (grad,) = torch.autograd.grad(loss_sum, hidden)
    assert torch.isfinite(grad).all() and grad[:, 0].abs().sum() == 0  # slot 0 is never scored


def test_expected_rejections_by_hand():
    """alpha = [-, .5, .8, .4], all labelled: accepted = .5 + .4 + .16 = 1.06 of 3; slot 2 masked: .5 of 2."""
    alpha = torch.tensor([[0.9, 0.5, 0.8, 0.4], [0.9, 0.5, 0.8, 0.4]])
    mask = torch.tensor([[False, True, True, True], [False, True, False, True]])
    assert torch.allclose(expected_rejections(alpha, mask), torch.tensor([3 - 1.06, 2 - 0.5]))
    assert expected_rejections(torch.ones(1, 4), mask[:1]).item() == 0  # accepted everywhere: nothing lost


@pytest.mark.parametrize("objective", ACCEPTANCE)
def test_acceptance_losses_at_temperature_use_the_tempered_distributions(objective):
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5)) * 2
    plain = block_loss(hidden, W, labels, mask, 2.0, target_logits=target, objective=objective)[0]
    hot = block_loss(hidden, W, labels, mask, 2.0, target_logits=target, objective=objective, temperature=2.0)[0]
    # the loss at T is the loss at 1 of both logits divided by T (the drafter's through its hidden states)
    cool = block_loss(hidden / 2.0, W, labels, mask, 2.0, target_logits=target / 2.0, objective=objective)[0]
    assert abs(hot.item() - plain.item()) > 1e-3 and torch.allclose(hot, cool, atol=1e-5)


def test_nla_stays_finite_with_its_gradient_when_alpha_is_tiny():
    """Target and drafter sure of different tokens: alpha ~ e^-60, far below a float32 clamp's reach."""
    h = torch.zeros(2, 4, requires_grad=True)
    W = torch.eye(4) * 1.0
    labels = torch.tensor([0, 1])
    logits_bias = torch.tensor([[60.0, 0, 0, 0], [0, 60.0, 0, 0]])
    target = torch.tensor([[0, 0, 60.0, 0], [0, 0, 0, 60.0]])
    row = row_losses(h + logits_bias, W, labels, 0, target, objective="nla")[0]
    assert torch.isfinite(row).all() and (row > 50).all()
    (grad,) = torch.autograd.grad(row.sum(), h)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    tv = row_losses(h + logits_bias, W, labels, 0, target, objective="tv")[0]
    assert torch.allclose(tv, torch.ones(2))


@pytest.mark.parametrize("objective", ACCEPTANCE)
@pytest.mark.parametrize("topk", [False, True])
def test_chunked_acceptance_rows_and_gradients_equal_the_plain_ones(objective, topk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=g, requires_grad=True)
    W = torch.randn(1000, 32, generator=g)
    labels = torch.randint(0, 1000, (300,), generator=g)
    target = torch.randn(300, 1000, generator=g)
    soft = (None, _topk_rows(target, 16)) if topk else (target, None)
    plain = row_losses(h, W, labels, 0, *soft, objective=objective)
    chunked = row_losses(h, W, labels, 64 * 1000, *soft, objective=objective)
    for a, b in zip(plain, chunked):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    (gp,) = torch.autograd.grad(plain[0].sum(), h)
    (gc,) = torch.autograd.grad(chunked[0].sum(), h)
    assert torch.isfinite(gp).all() and (gp - gc).abs().max() < 1e-5


@pytest.mark.parametrize("objective", ACCEPTANCE)
def test_topk_acceptance_is_the_full_one_with_the_whole_vocabulary(objective):
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5)) * 3
    for temperature in (1.0, 0.6):  # T != 1 renormalises over the k tokens: exact when they are all of them
        opts = {"objective": objective, "temperature": temperature}
        full = block_loss(hidden, W, labels, mask, 2.0, target_logits=target, **opts)[0]
        whole = block_loss(hidden, W, labels, mask, 2.0, target_topk=_topk_rows(target, 50), **opts)[0]
        assert torch.allclose(whole, full, atol=1e-4)
        (g,) = torch.autograd.grad(whole, hidden)
        assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_topk_acceptance_below_the_vocabulary_by_hand_and_an_upper_bound():
    g = torch.Generator().manual_seed(3)
    logits, target = torch.randn(40, 50, generator=g) * 2, torch.randn(40, 50, generator=g) * 3
    full = log_acceptance(logits, target).exp()
    for k in (1, 5, 20):
        lp, ids, rest = _topk_rows(target, k)
        top = log_acceptance_topk(logits, lp, ids, rest).exp()
        q = F.softmax(logits, -1)
        q_top = q.gather(-1, ids)
        by_hand = torch.minimum(lp.exp(), q_top).sum(-1) + torch.minimum(rest, 1 - q_top.sum(-1))
        assert torch.allclose(top, by_hand, atol=1e-5) and (top >= full - 1e-6).all()
    # T != 1: both distributions over the k tokens alone, tempered and renormalised; the rest bucket dropped
    lp, ids, rest = _topk_rows(target, 5)
    hot = log_acceptance_topk(logits, lp, ids, rest, temperature=2.0).exp()
    p, q = F.softmax(lp / 2.0, -1), F.softmax(logits.gather(-1, ids) / 2.0, -1)
    assert torch.allclose(hot, torch.minimum(p, q).sum(-1), atol=1e-6)


@pytest.mark.parametrize("objective", ACCEPTANCE)
def test_a_drafter_equal_to_the_target_loses_nothing(objective):
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    own = (hidden.reshape(-1, 8)[rows] @ W.T).detach() * 4  # peaked, and the drafter's own (x4: at T = 4)
    zero = block_loss(hidden * 4, W, labels, mask, 2.0, target_logits=own, objective=objective)[0]
    tempered = block_loss(hidden, W, labels, mask, 2.0, target_logits=own / 4, objective=objective,
                          temperature=0.25)[0]
    # expected_tau: block 1's slot 3 lies past its masked slot 2, where nothing is accepted: one slot lost
    lost = 1.0 if objective == "expected_tau" else 0.0
    assert abs(zero.item() - lost) < 1e-5 and abs(tempered.item() - lost) < 1e-5


def test_a_gradient_step_towards_the_target_lowers_expected_tau_loss():
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5)) * 2
    h = hidden.detach().clone().requires_grad_(True)
    before = block_loss(h, W, labels, mask, 2.0, target_logits=target, objective="expected_tau")[0]
    (grad,) = torch.autograd.grad(before, h)
    after = block_loss(h - 0.05 * grad, W, labels, mask, 2.0, target_logits=target, objective="expected_tau")[0]
    assert after.item() < before.item() - 1e-3


@pytest.mark.parametrize("objective", ACCEPTANCE)
def test_the_dflash2_selector_term_comes_with_the_acceptance_objectives(objective):
    torch.manual_seed(1)
    sel = CandidateSelector(8, 50, rank=4, top_k=5)
    hidden, W, labels, mask = _case()
    rows = label_rows(mask)
    target = torch.randn(rows.numel(), 50, generator=torch.Generator().manual_seed(5))
    ce_terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel)
    terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel, target_logits=target, objective=objective)
    assert terms.selector_sum.item() == pytest.approx(ce_terms.selector_sum.item(), rel=1e-5)
    assert terms.selector_weight_sum.item() == pytest.approx(ce_terms.weight_sum.item())
    assert torch.equal(terms.selector_predictions, ce_terms.selector_predictions)
    (grad,) = torch.autograd.grad(terms.loss_sum + terms.selector_sum, hidden)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("options,needle", [
    ({"objective": "tv"}, "objective=tv needs the target distribution"),
    ({"objective": "ce", "soft": True}, "objective=ce takes no target distribution"),
    ({"objective": "kl", "soft": True, "temperature": 2.0}, "temperature=2.0 applies to tv"),
    ({"objective": "tv", "soft": True, "temperature": 0.0}, "temperature=0.0 must be > 0"),
    ({"objective": "hinge", "soft": True}, "objective='hinge'"),
    ({"objective": "expected_tau", "soft": True, "weighting": "dpace"}, "expected_tau has no slot weights"),
])
def test_bad_objectives_are_refused(options, needle):
    hidden, W, labels, mask = _case()
    options = dict(options)
    soft = {"target_logits": torch.randn(int(mask.sum()), 50)} if options.pop("soft", False) else {}
    with pytest.raises(ValueError, match=needle):
        block_terms(hidden, W, labels, mask, 2.0, **soft, **options)
