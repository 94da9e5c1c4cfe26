"""DFlash 2's selector loss (dflash.drafter.selector_loss): each of its choices does what it says, and the coupled
gradient, added sparsely inside the chunk, is plain autograd's."""

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.dflash2 import CandidateSelector
from dflash.drafter.loss import block_terms, dpace_weights, label_rows, slot_weights
from dflash.drafter.model import Scales
from dflash.drafter.selector_loss import SelectorOptions, schedule_weight, selector_ce

V, H = 60, 16


def case(seed=0, blocks=(3, 5), B=6):
    """A selector with codebooks large enough to reorder candidates, hidden states [*blocks, B, H], a head [V, H]
    (with a gradient), labels and a mask with slot 0 and a few more unlabelled."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sel = CandidateSelector(H, V, rank=8, top_k=5)
    with torch.no_grad():
        sel.predecessor_codebook.mul_(20)
        sel.successor_codebook.mul_(20)
    hidden = torch.randn(*blocks, B, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (*blocks, B), generator=g)
    mask = torch.rand(*blocks, B, generator=g) > 0.15
    mask[..., 0] = False
    return sel, hidden, W, labels, mask


def reference(sel, hidden, W, labels, mask, gamma, weighting, scales):
    """Plain autograd, the whole batch at once, the unary scores not detached: the per-slot CE and the selector's
    (gold injected at rank K when missing), both weighted by the per-slot loss's weights."""
    rows = label_rows(mask)
    h = hidden.reshape(-1, H)[rows]
    y = labels.reshape(-1)[rows]
    prev = torch.roll(labels, 1, -1).reshape(-1)[rows]
    logits = scales.logits(h, W)
    ce = F.cross_entropy(logits, y, reduction="none")
    if weighting == "dpace":
        q = torch.zeros(labels.numel())
        q[rows] = torch.exp(-ce.detach())
        w = dpace_weights(q.view(labels.shape), mask, 0.5).reshape(-1)[rows]
    else:
        w = (slot_weights(labels.shape[-1], gamma) * mask).reshape(-1)[rows]
    cand = logits.detach().topk(sel.top_k, dim=-1).indices
    held = (cand == y[:, None]).any(-1)
    cand[:, -1] = torch.where(held, cand[:, -1], y)
    place = (cand == y[:, None]).int().argmax(-1)
    scores = logits.gather(-1, cand) + sel.pairwise(h, prev, cand)
    return (w * ce).sum() + (w * F.cross_entropy(scores, place, reduction="none")).sum()


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [0, 7 * V], ids=["whole", "chunked"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("scales", [Scales(), Scales(output_multiplier=0.7, final_logit_softcapping=3.0)],
                         ids=["plain", "softcap"])
def test_coupled_gradients_are_plain_autograds(chunk, weighting, scales):
    """hidden, head weight, codebooks and projection: the chunked (checkpointed) and whole paths, decay and D-PACE
    weights (the selector following them), within 1e-5 relative of the plain autograd reference."""
    sel, hidden, W, labels, mask = case()
    hidden.requires_grad_(True)
    W.requires_grad_(True)
    params = (hidden, W, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight)
    options = {} if weighting == "decay" else {"weighting": "dpace", "alpha": 0.5}
    terms = block_terms(hidden, W, labels, mask, 2.0, chunk, selector=sel, scales=scales,
                        selector_options=SelectorOptions(gradient="coupled", weights="follow"), **options)
    ours = grads(terms.loss_sum + terms.selector_sum, *params)
    theirs = grads(reference(sel, hidden, W, labels, mask, 2.0, weighting, scales), *params)
    for name, a, b in zip(("hidden", "head", "predecessor", "successor", "projection"), ours, theirs):
        assert b.abs().max() > 0, name
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name
    # and the detached gradient is not that: the coupled one reaches the unary logits
    detached = block_terms(hidden, W, labels, mask, 2.0, chunk, selector=sel, scales=scales,
                           selector_options=SelectorOptions(gradient="detach_unary", weights="follow"), **options)
    assert not torch.allclose(grads(detached.loss_sum + detached.selector_sum, W)[0], ours[1], rtol=1e-3)


def test_the_coupled_gradient_makes_no_dense_gather_backward():
    """The selector's gradient reaches the logits through _SparseUnary's scatter-add into the per-slot loss's
    gradient: no GatherBackward over the [rows, V] logits in the graph (autograd's would make a second dense
    [rows, V] gradient and add the two)."""
    sel, hidden, W, labels, mask = case()
    hidden.requires_grad_(True)
    terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel, selector_options=SelectorOptions("coupled"))
    seen, todo = set(), [(terms.loss_sum + terms.selector_sum).grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo += [f for f, _ in fn.next_functions]
    names = {type(fn).__name__ for fn in seen}
    assert "_SparseUnaryBackward" in names and "GatherBackward0" not in names


def selector_grads(gradient):
    sel, hidden, W, labels, mask = case(1)
    hidden = hidden.reshape(-1, H)[:20].requires_grad_(True)
    logits = (hidden.detach() @ W.T).requires_grad_(True)
    y, prev = labels.reshape(-1)[:20], labels.reshape(-1)[20:40]
    out, terms = selector_ce(sel, hidden, logits, y, prev, options=SelectorOptions(gradient))
    terms.ce.sum().backward()
    return sel, hidden.grad, logits.grad, out is logits


@pytest.mark.parametrize("gradient", ["coupled", "detach_unary", "stop"])
def test_each_gradient_choice_reaches_what_it_says(gradient):
    """coupled: the unary logits, the hidden states and the selector; detach_unary: not the logits; stop: the
    selector's own parameters only."""
    sel, hidden_grad, logits_grad, same = selector_grads(gradient)
    assert sel.predecessor_codebook.grad.abs().sum() > 0 and sel.hidden_projection.weight.grad.abs().sum() > 0
    assert (logits_grad is not None) == (gradient == "coupled")
    assert (hidden_grad is not None) == (gradient != "stop")
    assert same == (gradient != "coupled")  # coupled hands back the logits its per-slot loss must read
    if gradient == "coupled":  # K + 1 entries a row at most: the candidates and the gold token
        assert ((logits_grad != 0).sum(-1) <= 6).all()


def test_strict_gold_gives_a_row_outside_the_candidates_no_loss_and_no_weight():
    sel, hidden, W, labels, mask = case(2)
    rows = label_rows(mask)
    logits = hidden.reshape(-1, H)[rows] @ W.T
    top = logits.topk(5, dim=-1).indices
    labels.view(-1)[rows[:4]] = top[:4, 2]  # inside the top-K
    labels.view(-1)[rows[4:8]] = logits[4:8].argsort(-1)[:, 0]  # the lowest logit: outside
    y, prev = labels.reshape(-1)[rows], torch.roll(labels, 1, -1).reshape(-1)[rows]
    inject = selector_ce(sel, hidden.reshape(-1, H)[rows], logits, y, prev)[1]
    strict = selector_ce(sel, hidden.reshape(-1, H)[rows], logits, y, prev, options=SelectorOptions(gold="strict"))[1]
    held = (top == y[:, None]).any(-1)
    assert torch.equal(strict.counted, held) and inject.counted.all() and not held[4:8].any() and held[:4].all()
    assert torch.equal(strict.ce, torch.where(held, inject.ce, 0.0)) and (inject.ce[~held] > 0).all()
    decay = (slot_weights(6, 2.0) * mask).reshape(-1)
    for options in ({}, {"weighting": "dpace"}):  # both loss paths
        terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel, selector_options=SelectorOptions(gold="strict"),
                            **options)
        assert terms.selector_sum.item() == pytest.approx((decay[rows] * strict.ce).sum().item(), rel=1e-5)
        assert terms.selector_weight_sum.item() == pytest.approx(decay[rows][held].sum().item(), rel=1e-6)


def test_follow_weights_the_selector_as_the_per_slot_loss():
    """Under D-PACE, weights=follow gives the selector the D-PACE weights (sum and normaliser); decay keeps it on
    the decay weights."""
    sel, hidden, W, labels, mask = case(3)
    rows = label_rows(mask)
    h = hidden.reshape(-1, H)[rows]
    logits = h @ W.T
    _, plain = selector_ce(sel, h, logits, labels.reshape(-1)[rows], torch.roll(labels, 1, -1).reshape(-1)[rows])
    q = torch.zeros(labels.numel())
    q[rows] = torch.exp(-F.cross_entropy(logits, labels.reshape(-1)[rows], reduction="none"))
    dpace = dpace_weights(q.view(labels.shape), mask, 0.5).reshape(-1)
    decay = (slot_weights(6, 2.0) * mask).reshape(-1)
    for weights, w in (("follow", dpace), ("decay", decay)):
        terms = block_terms(hidden, W, labels, mask, 2.0, weighting="dpace", selector=sel,
                            selector_options=SelectorOptions(weights=weights))
        assert terms.selector_sum.item() == pytest.approx((w[rows] * plain.ce).sum().item(), rel=1e-5)
        assert terms.selector_weight_sum.item() == pytest.approx(w.sum().item(), rel=1e-6)


def test_the_gold_tokens_are_what_the_ce_trains_towards_and_the_oracle_reads_the_labels():
    """selector_labels=target: the CE's gold is the given token (the target's argmax), the oracle still the data's
    label (what train/oracle scores)."""
    sel, hidden, W, labels, mask = case(4)
    h = hidden.reshape(-1, H)[:12]
    logits = h @ W.T
    top = logits.topk(5, dim=-1).indices
    data, argmax = top[:, 1], top[:, 0]  # both among the candidates, different
    prev = labels.reshape(-1)[:12]
    _, on_data = selector_ce(sel, h, logits, data, prev)
    _, on_target = selector_ce(sel, h, logits, data, prev, gold=argmax)
    scores = logits.gather(-1, top) + sel.pairwise(h, prev, top)
    assert torch.allclose(on_target.ce, F.cross_entropy(scores, torch.zeros(12, dtype=torch.long), reduction="none"))
    assert torch.allclose(on_data.ce, F.cross_entropy(scores, torch.ones(12, dtype=torch.long), reduction="none"))
    assert torch.equal(on_target.oracle, data) and torch.equal(on_target.choice, on_data.choice)
    given = labels.reshape(-1)[label_rows(mask)]  # the labels themselves, given: the same loss as without them
    terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel, selector_labels=given)
    plain = block_terms(hidden, W, labels, mask, 2.0, selector=sel)
    assert terms.selector_sum.item() == pytest.approx(plain.selector_sum.item())


def test_dropout_drops_predecessor_rows_in_the_loss_only():
    """dropout p: the predecessor's codebook row through F.dropout (the same draw reproduced by hand), the same in
    the chunked path (its recompute replays the draw); decoding's scores have none."""
    sel, hidden, W, labels, mask = case(5)
    h, y, prev = hidden.reshape(-1, H)[:30], labels.reshape(-1)[:30], labels.reshape(-1)[30:60]
    logits = h @ W.T
    torch.manual_seed(7)
    _, dropped = selector_ce(sel, h, logits, y, prev, options=SelectorOptions(dropout=0.5))
    torch.manual_seed(7)
    pred = F.dropout(F.embedding(prev, sel.predecessor_codebook), 0.5)
    cand = logits.topk(5, dim=-1).indices
    held = (cand == y[:, None]).any(-1)
    cand[:, -1] = torch.where(held, cand[:, -1], y)
    scores = logits.gather(-1, cand) + torch.einsum("nr,nkr->nk", pred * sel.hidden_projection(h),
                                                    sel.successor_codebook[cand])
    expected = F.cross_entropy(scores, (cand == y[:, None]).int().argmax(-1), reduction="none")
    assert torch.allclose(dropped.ce, expected, atol=1e-5)
    _, plain = selector_ce(sel, h, logits, y, prev)
    assert not torch.allclose(dropped.ce, plain.ce)
    assert torch.equal(sel.scores(h, logits[:, :5], cand, prev), logits[:, :5] + sel.pairwise(h, prev, cand))


def test_the_chunked_dropout_draw_is_replayed_in_backward():
    """The checkpointed chunks recompute their forward in backward: the dropout masks must be the forward's, or
    the gradient is another loss's. On the CPU a chunk after chunk draws the same masks as one draw for all rows,
    so the chunked path equals the whole one, value and gradient."""
    sel, hidden, W, labels, mask = case(6)
    hidden.requires_grad_(True)
    options = SelectorOptions(dropout=0.5)
    out = []
    for chunk in (0, 7 * V):  # 0: no chunking; 7 x V: checkpointed chunks of 7 rows
        torch.manual_seed(11)
        terms = block_terms(hidden, W, labels, mask, 2.0, chunk, selector=sel, selector_options=options)
        out.append((terms.selector_sum.detach(), grads(terms.selector_sum, hidden, sel.predecessor_codebook)))
    (value, (g_h, g_p)), (chunked, (c_h, c_p)) = out
    assert chunked.item() == pytest.approx(value.item(), rel=1e-6)
    assert torch.allclose(g_h, c_h, atol=1e-6) and torch.allclose(g_p, c_p, atol=1e-6)


@pytest.mark.parametrize("path", [{"chunk_logits": 0}, {"chunk_logits": 7 * V},
                                  {"chunk_logits": 7 * V, "fused_ce": False}], ids=["whole", "fused", "checkpointed"])
def test_dropout_leaves_the_served_choice_the_metrics_score(path):
    """dropout is the loss's regulariser only: the choice train/tau and acc@k score (shrink 0.6 on the pairwise term,
    as served) is the one without dropout, on every path of the loss, while the loss is the dropped-out one (issue
    65: the metric scored the dropped-out scores)."""
    sel, hidden, W, labels, mask = case(5)
    out = {}
    for dropout in (0.0, 0.5):
        torch.manual_seed(3)
        out[dropout] = block_terms(hidden, W, labels, mask, 2.0, selector=sel,
                                   selector_options=SelectorOptions(dropout=dropout, shrink=0.6), **path)
    plain, dropped = out[0.0], out[0.5]
    assert not torch.allclose(dropped.selector_sum, plain.selector_sum)
    assert torch.equal(dropped.selector_predictions, plain.selector_predictions)
    assert torch.equal(dropped.oracle_predictions, plain.oracle_predictions)
    assert (plain.selector_predictions >= 0).sum() > 50  # rows enough for a noisy choice to show


@pytest.mark.parametrize("options,needle", [
    ({"gradient": "both"}, "gradient='both'"), ({"gold": "skip"}, "gold='skip'"), ({"weights": "dpace"}, "weights="),
    ({"dropout": 1.0}, "dropout=1.0")])
def test_bad_options_are_refused(options, needle):
    with pytest.raises(ValueError, match=needle):
        SelectorOptions(**options)


def test_the_weight_schedule_waits_then_ramps_linearly():
    seen = [schedule_weight(s, 100, 2.0, 0.1, 0.2) for s in range(101)]
    assert seen[:11] == [0.0] * 11  # 0 before and at the start of the ramp
    assert seen[20] == pytest.approx(1.0) and seen[15] == pytest.approx(0.5)
    assert seen[30:] == [2.0] * 71
    assert all(b >= a for a, b in zip(seen, seen[1:]))
    assert [schedule_weight(s, 100, 2.0) for s in (0, 50)] == [2.0, 2.0]  # no schedule
    assert [schedule_weight(s, 10, 1.0, 0.5) for s in (4, 5)] == [0.0, 1.0]  # a warmup without a ramp: a step
    assert schedule_weight(3, 0, 1.0, 0.5, 0.5) == 1.0  # no total (a step outside a run): the weight


@pytest.mark.parametrize("successor", [True, False])
def test_the_codebook_span_keeps_the_codebooks_in_the_span_of_the_targets_token_vectors(successor):
    """loss.selector.span: after the projection each codebook is E A for E's least-squares A (E the embeddings for
    the predecessor's, the head's rows for the successor's; predecessor alone leaves the successor's as it was);
    projecting again changes nothing, and rows read in chunks give what one pass gives."""
    from dflash.drafter.selector_loss import CodebookSpan

    torch.manual_seed(0)
    selector = CandidateSelector(16, 50, 8, 4)
    embedding, head = torch.randn(50, 16), torch.randn(50, 16)
    before = {n: p.detach().clone() for n, p in selector.named_parameters()}
    span = CodebookSpan(selector, embedding, head if successor else None, chunk_rows=7)
    for name, table in (("predecessor_codebook", embedding), ("successor_codebook", head)):
        least = table @ torch.linalg.lstsq(table, before[name]).solution
        now = getattr(selector, name).detach()
        assert torch.allclose(now, least if successor or name == "predecessor_codebook" else before[name], atol=1e-5)
    assert not torch.allclose(selector.predecessor_codebook, before["predecessor_codebook"], atol=1e-3)
    projected = {n: p.detach().clone() for n, p in selector.named_parameters()}
    span()
    assert all(torch.allclose(p, projected[n], atol=1e-5) for n, p in selector.named_parameters())
    whole = CandidateSelector(16, 50, 8, 4)
    whole.load_state_dict(before)
    CodebookSpan(whole, embedding, head if successor else None)
    assert all(torch.allclose(p, projected[n], atol=1e-5) for n, p in whole.named_parameters())


def test_shrink_scores_the_served_choice_and_leaves_the_loss_as_trained():
    """loss.selector.shrink s: the loss (and its gradient) is the one at weight 1; the choice the metrics score is the
    best of unary + s x pairwise over the top-K (s = 0: the unary argmax), as the served drafter (its predecessor
    codebook times s) chooses; served_weights scales that codebook alone, served_selector restores it exactly."""
    from dflash.drafter.selector_loss import served_selector, served_weights

    sel, hidden, W, labels, mask = case(6)
    h, y, prev = hidden.reshape(-1, H)[:30], labels.reshape(-1)[:30], labels.reshape(-1)[30:60]
    logits = h @ W.T
    _, full = selector_ce(sel, h, logits, y, prev)
    choices = {}
    for s in (0.0, 0.4):
        _, shrunk = selector_ce(sel, h, logits, y, prev, options=SelectorOptions(shrink=s))
        assert torch.equal(shrunk.ce, full.ce)
        unary, cand = logits.topk(5, dim=-1)
        expected = cand.gather(-1, (unary + s * sel.pairwise(h, prev, cand)).argmax(-1, keepdim=True))[:, 0]
        assert torch.equal(shrunk.choice, expected)
        choices[s] = shrunk.choice
    assert torch.equal(choices[0.0], logits.argmax(-1))
    assert not torch.equal(choices[0.4], full.choice) or not torch.equal(choices[0.0], full.choice)

    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.candidate_selector = sel

    drafter = Drafter()
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    served = served_weights(weights, 0.4)
    assert set(served) == set(weights)
    for key, value in served.items():
        factor = 0.4 if key.endswith("predecessor_codebook") else 1.0
        assert torch.equal(value, weights[key] * factor) if factor != 1.0 else value is weights[key]
    assert served_weights(weights, 1.0) is weights
    with served_selector(drafter, 0.4):
        assert torch.equal(sel.predecessor_codebook, served["candidate_selector.predecessor_codebook"])
        assert torch.equal(sel.successor_codebook, weights["candidate_selector.successor_codebook"])
    assert all(torch.equal(v, weights[k]) for k, v in drafter.state_dict().items())
