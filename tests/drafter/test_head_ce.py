"""The head's CE (dflash.drafter.head_ce): WeightedCE on given logits against autograd's, and loss.fused_ce, the
chunked head CE with its gradients made in the forward, equal to the checkpointed chunks it replaces and the
unchunked loss, running the head's matmul once a row instead of twice."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash.drafter.head_ce import fused_head_ce, weighted_ce_sum
from dflash.drafter.loss import block_terms, head_logits, weighted_ce
from dflash.drafter.model import Scales

N, H, V = 37, 16, 50
CHUNK = 10 * V  # 10 rows a chunk: four chunks, the last one short
GEMMA = Scales(output_multiplier=0.7, final_logit_softcapping=5.0)


def problem(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) * 2).to(dtype)
    head = torch.randn(V, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    weight = torch.rand(N, generator=g) + 0.1
    return hidden, head, labels, weight


def loss_and_grads(hidden, head, labels, weight, chunk_logits, fused, scales=None, autocast=None):
    """(loss, predictions, d/d hidden, d/d weight) of 1.7 x the weighted CE; autocast: None, or the device type to
    run under bf16 autocast ("cpu", "cuda")."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=bool(autocast)):
        loss, pred = weighted_ce(h, head, labels, w, chunk_logits, scales=scales, fused=fused)
    (loss * 1.7).backward()  # an upstream gradient other than 1
    return loss.detach(), pred, h.grad, w.grad


@pytest.mark.parametrize("scales", [None, GEMMA], ids=["qwen", "softcap_and_multiplier"])
def test_equals_the_checkpointed_chunks_and_the_unchunked_loss(scales):
    args = problem()
    fused = loss_and_grads(*args, CHUNK, True, scales)
    for other in (loss_and_grads(*args, CHUNK, False, scales), loss_and_grads(*args, 0, True, scales)):
        assert torch.allclose(fused[0], other[0], rtol=1e-6)
        assert torch.equal(fused[1], other[1])
        assert torch.allclose(fused[2], other[2], rtol=1e-5, atol=1e-7)
        assert torch.allclose(fused[3], other[3], rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_it_equals_the_checkpointed_chunks():
    """bf16 autocast (a bf16 head, as a bf16 target lends it): the same head matmul in bf16 and float32 softmax give
    the same loss and predictions. The hidden states' gradient goes back through the bf16 matmul before the upstream
    gradient scales it (the recomputed path scales first), so the two round differently: each is compared with
    the float32 gradient, and the fused one is no further from it (0.076 against 0.080 of a largest entry 8.1)."""
    hidden, head, labels, weight = problem(1)
    head = head.to(torch.bfloat16)
    fused = loss_and_grads(hidden, head, labels, weight, CHUNK, True, autocast="cpu")
    ref = loss_and_grads(hidden, head, labels, weight, CHUNK, False, autocast="cpu")
    exact = loss_and_grads(hidden, head.float(), labels, weight, CHUNK, False)
    assert torch.allclose(fused[0], ref[0], rtol=1e-5) and torch.equal(fused[1], ref[1])
    assert (fused[2] - exact[2]).abs().max() <= (ref[2] - exact[2]).abs().max()


def test_the_head_matmul_runs_once_a_row():
    """The checkpointed path makes each chunk's logits twice (forward, recompute) and back-propagates once: 3 head
    matmuls a row; the fused one 2."""
    args = problem()

    def flops(fused):
        with FlopCounterMode(display=False) as fc:
            loss_and_grads(*args, CHUNK, fused)
        return fc.get_total_flops()

    per_matmul = 2 * N * H * V
    assert flops(False) == 3 * per_matmul and flops(True) == 2 * per_matmul


def test_a_trainable_head_keeps_the_checkpointed_path_and_the_function_refuses_it():
    hidden, head, labels, weight = problem()
    head.requires_grad_(True)
    loss, _ = weighted_ce(hidden.requires_grad_(True), head, labels, weight, CHUNK, fused=True)
    loss.backward()
    assert head.grad is not None  # trained: the checkpointed chunks ran
    with pytest.raises(ValueError, match="loss.fused_ce=false"):
        fused_head_ce(hidden, head, labels, weight, 10, lambda h, w: head_logits(h, w))


def test_block_terms_take_the_key_and_the_selector_keeps_the_recompute():
    """block_terms(fused_ce=...) reaches the chunked CE; with fused_ce the training loss is the same number."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 8, H, generator=g)
    labels = torch.randint(0, V, (2, 3, 8), generator=g)
    mask = torch.ones(2, 3, 8, dtype=torch.bool)
    mask[..., 0] = False
    head = torch.randn(V, H, generator=g)
    a, b = (block_terms(hidden, head, labels, mask, 7.0, CHUNK, fused_ce=f) for f in (True, False))
    assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-6) and torch.equal(a.predictions, b.predictions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_at_the_27b_head_it_equals_the_recomputed_chunks():
    """Qwen3.6-27B's head (hidden 5120, vocabulary 248320, bf16 as the target lends it) under bf16 autocast, 1024
    rows in the default loss.chunk_logits's chunks of 540: the same loss and predictions; the hidden states'
    gradient no further from the float32 head's than the recomputed path's is (1.05x for a different rounding)."""
    g = torch.Generator("cuda").manual_seed(0)  # made on the GPU: a 5 GB head drawn on the host takes its time
    hidden = torch.randn(1024, 5120, generator=g, device="cuda")
    head = torch.randn(248320, 5120, generator=g, device="cuda") / 5120**0.5
    labels = torch.randint(0, 248320, (1024,), generator=g, device="cuda")
    weight = torch.rand(1024, generator=g, device="cuda") + 0.1
    bf16 = head.to(torch.bfloat16)
    fused = loss_and_grads(hidden, bf16, labels, weight, 2**27, True, autocast="cuda")
    ref = loss_and_grads(hidden, bf16, labels, weight, 2**27, False, autocast="cuda")
    exact = loss_and_grads(hidden, head, labels, weight, 2**27, False)
    assert torch.allclose(fused[0], ref[0], rtol=1e-4) and (fused[1] == ref[1]).float().mean() > 0.999
    assert (fused[2] - exact[2]).abs().max() <= 1.05 * (ref[2] - exact[2]).abs().max()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("gradient,gold,dropout,scales", [
    ("coupled", "inject", 0.0, None), ("coupled", "strict", 0.0, GEMMA), ("detach_unary", "inject", 0.0, None),
    ("stop", "strict", 0.0, None), ("coupled", "inject", 0.3, GEMMA)])
def test_dflash2_fused_equals_the_recomputed_chunks(gradient, gold, dropout, scales, device, monkeypatch):
    """DFlash 2: the unary CE and the selector's CE with their gradients made in the forward (the coupled unary
    scores' gradient sent back through the head's K + 1 rows and the softcap's derivative) equal the checkpointed
    chunks: both sums, the predictions, choices, oracle and counted rows, and the gradients of the hidden states
    and of every selector parameter, with the two sums weighed by different factors as the training step does.
    Dropout draws the same masks: one forward each, the same seed."""
    import dflash.drafter.loss as loss_mod
    from dflash.drafter.dflash2 import CandidateSelector
    from dflash.drafter.selector_loss import SelectorOptions

    hidden, head, labels, weight = (t.to(device) for t in problem(2))
    g = torch.Generator().manual_seed(5)
    prev = torch.randint(0, V, (N,), generator=g).to(device)
    sel_weight = (torch.rand(N, generator=g) + 0.2).to(device)
    torch.manual_seed(0)
    selector = CandidateSelector(H, V, rank=6, top_k=5).to(device)
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 0.5)
        selector.predecessor_codebook.normal_(0, 0.5)
    options = SelectorOptions(gradient=gradient, gold=gold, dropout=dropout)

    def run(fused):
        selector.zero_grad()
        h = hidden.clone().requires_grad_(True)
        torch.manual_seed(1)
        out = weighted_ce(h, head, labels, weight, CHUNK, selector=selector, prev=prev, sel_weight=sel_weight,
                          scales=scales, options=options, fused=fused)
        (out[0] * 1.7 + out[2] * 0.3).backward()
        return out, h.grad, {n: p.grad.clone() for n, p in selector.named_parameters() if p.grad is not None}

    (fo, fh, fp), (ro, rh, rp) = run(True), run(False)
    assert torch.allclose(fo[0], ro[0], rtol=1e-6) and torch.allclose(fo[2], ro[2], rtol=1e-5)
    for a, b in zip(fo[1:2] + fo[3:], ro[1:2] + ro[3:]):
        assert torch.equal(a, b)
    assert torch.allclose(fh, rh, rtol=1e-4, atol=1e-6), (fh - rh).abs().max()
    assert sorted(fp) == sorted(rp) and len(fp) == 3  # both codebooks and the projection
    for name in fp:
        assert torch.allclose(fp[name], rp[name], rtol=1e-4, atol=1e-6), name
    rows = []  # the head's logits made: once a row fused, twice checkpointed (forward, then the recompute)
    monkeypatch.setattr(loss_mod, "head_logits", lambda h, w, s=None: rows.append(len(h)) or head_logits(h, w, s))
    run(True)
    fused_rows = sum(rows)
    run(False)
    assert fused_rows == N and sum(rows) - fused_rows == 2 * N


def test_weighted_ce_equals_autograds_cross_entropy_in_value_and_gradients():
    """WeightedCE's one-tensor backward against autograd's cross_entropy (float64): the same sum, the same gradient
    for the logits and for weights that carry one; fails on a backward that drops the one-hot (softmax alone) or the
    weights."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[:5] = labels[5]  # repeated labels: the one-hot of each row, not accumulated across rows
    weight = torch.rand(37, generator=g, dtype=torch.float64)
    a, wa = logits.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    b, wb = logits.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ours = weighted_ce_sum(a, labels, wa)
    ref = (torch.nn.functional.cross_entropy(b, labels, reduction="none") * wb).sum()
    (2.5 * ours).backward()
    (2.5 * ref).backward()
    assert torch.allclose(ours, ref, rtol=1e-12)
    assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12) and torch.allclose(wa.grad, wb.grad, rtol=1e-12)
    small = (logits[:6, :7].clone().requires_grad_(True), weight[:6].clone().requires_grad_(True))
    assert torch.autograd.gradcheck(lambda x, w: weighted_ce_sum(x, labels[:6] % 7, w), small)
