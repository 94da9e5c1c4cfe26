"""DFlash 2: the convolution at block boundaries, identity init, the selector's loss and trees, the published
layout both ways (our export in the z-lab reference class, the reference's decoding equal to ours)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash.drafter import dflash2
from dflash.drafter.build import load_drafter, save_drafter
from dflash.drafter.build import drafter_config
from dflash.drafter.decoding.ddtree import build_tree, build_tree_pairwise
from dflash.drafter.dflash2 import CandidateSelector, grouped_dynamic_conv, selector_tables, walk_path
from dflash.drafter.loss import block_terms, slot_weights
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.selector_loss import SelectorOptions, selector_ce
from tests.drafter.test_blocks import assert_packed_equals_one_block
from tests.drafter.test_model import TARGET, inputs
from tests.zlab import reference

B, MASK = 8, 299
KEYS2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 8}


def make_dflash2(layer_types=None, window=None, sliding_causal=False, seed=0, scale=0.05, keys=KEYS2):
    """A DFlash 2 drafter with every weight moved off its init (convolutions no longer the identity)."""
    torch.manual_seed(seed)
    cfg = drafter_config(TARGET, num_layers=2, block_size=B, target_layer_ids=[1, 5, 9], mask_token_id=MASK,
                         layer_types=layer_types, sliding_window=window, dflash2=keys, sliding_causal=sliding_causal)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if "conv" in name else scale) * torch.randn_like(p) * (0.3 if "conv" in name else 1))
    return model


def naive_conv(z, base, dynamic, group_size, block_len):
    """conv(z, b, d)[t] = sum_o (b[o] + d[t, o, group]) z[t - o], zero before each block: one loop per entry."""
    b, q, H = z.shape
    out = torch.zeros_like(z)
    for i in range(b):
        for t in range(q):
            for o in range(base.shape[0]):
                if t % block_len - o < 0:
                    continue
                for c in range(H):
                    out[i, t, c] += (base[o, c] + dynamic[i, t, o, c // group_size]) * z[i, t - o, c]
    return out


@pytest.mark.parametrize("k,block_len", [(2, 4), (3, 4), (2, 12)])
def test_convolution_equals_its_formula_and_never_crosses_a_block(k, block_len):
    g = torch.Generator().manual_seed(k)
    z, base = torch.randn(2, 12, 8, generator=g), torch.randn(k, 8, generator=g)
    dyn = torch.randn(2, 12, k, 2, generator=g)
    out = grouped_dynamic_conv(z, base, dyn, 4, block_len)
    assert (out - naive_conv(z, base, dyn, 4, block_len)).abs().max() < 1e-5
    if block_len < 12:  # one long sequence would carry taps across the block starts: a different result
        assert not torch.allclose(out, grouped_dynamic_conv(z, base, dyn, 4, 12))


def test_a_fresh_dflash2_drafter_computes_the_dflash_drafter():
    torch.manual_seed(0)
    one = DFlashDraftModel(drafter_config(TARGET, num_layers=2, block_size=B, target_layer_ids=[1, 5, 9],
                                          mask_token_id=MASK)).eval()
    two = DFlashDraftModel(drafter_config(TARGET, num_layers=2, block_size=B, target_layer_ids=[1, 5, 9],
                                          mask_token_id=MASK, dflash2=KEYS2)).eval()
    assert two.kind == "dflash2" and one.kind == "dflash"
    assert set(two.load_state_dict(one.state_dict(), strict=False).missing_keys) == {
        k for k in two.state_dict() if "conv" in k or "selector" in k}
    noise, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(one(noise, feats, pos), two(noise, feats, pos))


def test_an_export_records_its_selector_shrink_and_training_divides_it_out(tmp_path):
    """save_drafter(selector_shrink=s) saves the predecessor codebook times s and records s in dflash_config
    (selector_shrink); load_drafter serves the saved weights, load_trained (init_from, resume) starts from the trained
    ones (here, with no train_state/: saved / s) and forgets the key, so the next export records its own. A shrink of 0
    left nothing to divide: refused, naming the key."""
    from dflash.drafter.build import load_trained
    from dflash.errors import CheckpointError

    model = make_dflash2()
    key = "candidate_selector.predecessor_codebook"
    trained = model.state_dict()[key].clone()
    save_drafter(model, tmp_path / "s", selector_shrink=0.5)
    assert json.loads((tmp_path / "s" / "config.json").read_text())["dflash_config"]["selector_shrink"] == 0.5
    assert torch.equal(load_file(tmp_path / "s" / "model.safetensors")[key], trained * 0.5)
    assert torch.equal(load_drafter(str(tmp_path / "s")).state_dict()[key], trained * 0.5)
    resumed = load_trained(str(tmp_path / "s"))
    assert torch.equal(resumed.state_dict()[key], trained)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in resumed.state_dict().items())
    assert "selector_shrink" not in resumed.config.dflash_config
    save_drafter(model, tmp_path / "zero", selector_shrink=0.0)
    with pytest.raises(CheckpointError, match="dflash_config.selector_shrink=0.0.*train_state/"):
        load_trained(str(tmp_path / "zero"))


@pytest.mark.parametrize("layer_types,window,causal", [(None, None, False),
                                                       (["sliding_attention", "full_attention"], 5, True),
                                                       (["sliding_attention", "sliding_attention"], 5, False)])
def test_packed_dflash2_forward_equals_one_block_inference(layer_types, window, causal):
    """Taps and attention of packed training stop at every block start: block for block, what one-block
    inference computes (anchors adjacent to each other included)."""
    g = torch.Generator().manual_seed(3)
    ids, feats = torch.randint(0, 290, (1, 30), generator=g), torch.randn(1, 30, 3 * 64, generator=g)
    assert_packed_equals_one_block(make_dflash2(layer_types, window, causal), ids, feats,
                                   torch.tensor([1, 7, 8, 12, 13, 25, 29]))


def test_selector_loss_puts_the_gold_token_among_the_candidates_and_chooses_as_served():
    """Gold outside the unary top-K takes the K-th place in the loss; the CE is over K candidates, scored unary +
    pairwise with the previous gold token as predecessor, and trains the codebooks, the projection and the hidden
    states. The choice is among the unary top-K alone, as decoding chooses: a gold token outside them, scored
    above all of them here, is never chosen (it was, and train/tau counted it), and the oracle says it is missing."""
    torch.manual_seed(0)
    sel = CandidateSelector(16, 50, rank=8, top_k=4)
    hidden = torch.randn(3, 16, requires_grad=True)
    logits = torch.randn(3, 50, requires_grad=True)
    order = logits.detach().argsort(-1, descending=True)
    labels = torch.stack([order[0, 0], order[1, 2], order[2, 30]])  # in the top-4, in it, far outside it
    prev = torch.tensor([5, 6, 7])
    with torch.no_grad():  # the missing gold token's pairwise score far above every candidate's
        mixed = sel.predecessor_codebook[7] * sel.hidden_projection(hidden[2])
        sel.successor_codebook[labels[2]] = 100 * mixed / mixed.norm()
    _, (ce, choice, oracle, counted) = selector_ce(sel, hidden, logits, labels, prev,
                                                   options=SelectorOptions(gradient="detach_unary"))
    assert counted.all()  # gold=inject: every row counts
    for i in range(3):
        strict = order[i, :4].clone()
        cand = strict.clone()
        if labels[i] not in cand:
            cand[-1] = labels[i]

        def score(c):
            pair = (sel.predecessor_codebook[prev[i]] * sel.hidden_projection(hidden[i])) @ sel.successor_codebook[c].T
            return logits[i, c] + pair

        gold = int((cand == labels[i]).nonzero())
        assert ce[i].item() == pytest.approx(F.cross_entropy(score(cand)[None], torch.tensor([gold])).item(), rel=1e-5)
        assert choice[i] == strict[score(strict).argmax()]
        assert oracle[i] == (labels[i] if labels[i] in strict else -1)
    assert score(cand).argmax() == 3 and choice[2] != labels[2]  # the injected gold would have won
    ce.sum().backward()
    assert sel.predecessor_codebook.grad[5:8].abs().sum() > 0 and sel.hidden_projection.weight.grad.abs().sum() > 0
    assert hidden.grad.abs().sum() > 0  # through the projection: the drafter is trained by the selector too
    assert logits.grad is None  # detach_unary: the unary scores are the per-slot loss's to train


def test_joint_loss_terms_weigh_the_selector_by_the_decay_weights():
    torch.manual_seed(1)
    sel = CandidateSelector(8, 40, rank=4, top_k=5)
    hidden, W = torch.randn(2, 3, 4, 8), torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 3, 4))
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[..., 0] = False
    mask[1, 2, 3] = False
    terms = block_terms(hidden, W, labels, mask, 2.0, selector=sel)
    rows = mask.reshape(-1).nonzero().flatten()
    prev = torch.roll(labels, 1, -1).reshape(-1)[rows]  # slot k after slot k-1's label, slot 1 after the anchor
    flat_h = hidden.reshape(-1, 8)[rows]
    _, (ce, choice, oracle, _) = selector_ce(sel, flat_h, flat_h @ W.T, labels.reshape(-1)[rows], prev)
    w = (slot_weights(4, 2.0) * mask).reshape(-1)[rows]
    assert terms.selector_sum.item() == pytest.approx((ce * w).sum().item(), rel=1e-5)
    assert terms.selector_weight_sum.item() == terms.weight_sum.item() == pytest.approx(w.sum().item())
    assert torch.equal(terms.selector_predictions.reshape(-1)[rows], choice)
    assert torch.equal(terms.oracle_predictions.reshape(-1)[rows], oracle)
    for kind in ({"weighting": "dpace"}, {"target_logits": torch.randn(len(rows), 40)}):  # any per-slot loss
        other = block_terms(hidden, W, labels, mask, 2.0, selector=sel, **kind)
        assert other.selector_sum.item() == pytest.approx(terms.selector_sum.item(), rel=1e-5)


def test_the_selector_walk_follows_its_own_choices():
    torch.manual_seed(2)
    sel = CandidateSelector(16, 60, rank=8, top_k=5)
    with torch.no_grad():
        sel.predecessor_codebook.mul_(100)  # pairwise scores large enough to reorder the candidates
        sel.successor_codebook.mul_(100)
    hidden, logits, anchor = torch.randn(1, 6, 16), torch.randn(1, 6, 60), torch.tensor([3])
    cand, first, table = (t[0] for t in selector_tables(sel, hidden, logits, anchor))
    path = walk_path(cand, first, table)
    unary, cands = sel.candidates(logits[0])
    prev, expected = 3, []
    for s in range(6):  # the reference loop: one slot at a time, the previous choice as predecessor
        scores = sel.scores(hidden[0, s], unary[s], cands[s], torch.tensor(prev))
        prev = int(cands[s, scores.argmax()])
        expected.append(prev)
    assert path == expected and path != logits[0].argmax(-1).tolist()


def test_pairwise_tree_without_pairwise_terms_is_the_marginal_tree():
    """With rows that ignore the parent, the pairwise DDTree holds the marginal DDTree's nodes; the trees are
    nested in the budget."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 6, generator=g), -1)
    cand = torch.randperm(100, generator=g)[:30].view(5, 6)
    top = logp.sort(-1, descending=True)
    ids = cand.gather(-1, top.indices)
    table = logp[1:, None, :].expand(4, 6, 6)
    for budget in (1, 4, 9, 20):
        pair = build_tree_pairwise(cand.tolist(), logp[0].tolist(), table.tolist(), budget)
        marginal = build_tree(ids.tolist(), top.values.tolist(), budget)
        assert len(pair.tokens) == budget
        assert sorted(zip(pair.depths, pair.tokens)) == sorted(zip(marginal.depths, marginal.tokens))
    conditional = torch.log_softmax(torch.randn(4, 6, 6, generator=g), -1).tolist()
    small, big = (build_tree_pairwise(cand.tolist(), logp[0].tolist(), conditional, n, max_depth=4) for n in (5, 12))
    assert big.tokens[:5] == small.tokens and big.parents[:5] == small.parents and max(big.depths) <= 4


def test_export_is_the_published_layout_and_loads_back_exactly(tmp_path):
    model = make_dflash2(["sliding_attention", "sliding_attention"], 5, False)
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert config["dflash_config"] == {**KEYS2, "block_size": B, "mask_token_id": MASK, "target_layer_ids": [1, 5, 9],
                                       "causal": False, "use_swa": True, "swa_window_size": 5}
    assert config["is_causal"] is False
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    assert {f"layers.{i}.{c}.{w}" for i in range(2) for c in ("attention_conv", "mlp_conv")
            for w in ("base_kernel", "kernel_projection.weight")} <= names
    loaded = load_drafter(str(tmp_path))
    assert type(loaded).__name__ == "DFlash2DraftModel" and loaded.kind == "dflash2"
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("layer_types,window,causal", [(None, None, False),
                                                       (["sliding_attention", "sliding_attention"], 5, False),
                                                       (["sliding_attention", "full_attention"], 5, True)])
def test_the_zlab_reference_class_loads_our_export_and_computes_the_same(tmp_path, layer_types, window, causal):
    """No missing or unexpected keys; the same hidden states with the reference's own masks (a non-causal sliding
    layer: |q - k| < W), the same logits and the same proposals from its selector."""
    ref = reference()
    model = make_dflash2(layer_types, window, causal)
    save_drafter(model, tmp_path)
    theirs, info = ref.DFlash2DraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    theirs.eval()
    noise, feats, pos = inputs(ctx=11, q=B)
    head = torch.nn.Linear(64, 300, bias=False)
    with torch.no_grad():
        ours = model(noise, feats, pos)
        out = theirs(position_ids=pos, noise_embedding=noise, target_hidden=feats)
        assert (ours - out).abs().max() < 1e-5
        hidden = ours[:, 1:]
        logits = head(hidden)
        anchor = torch.tensor([4, 9])
        tokens, cand, _ = theirs.propose(out[:, 1:], anchor, head, 0.0)
        for b in range(2):
            tables = [t[0] for t in selector_tables(model.candidate_selector, hidden[b:b + 1], logits[b:b + 1],
                                                    anchor[b:b + 1])]
            assert walk_path(*tables) == tokens[b].tolist()


def test_convolution_gradients_are_exact():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    base = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dyn = torch.randn(2, 8, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: grouped_dynamic_conv(a, b, c, 4, 4), (z, base, dyn))


@pytest.mark.parametrize("row_by_row", [True, False])
def test_selector_pairwise_gradients_are_exact_and_equal_embedding_and_einsum(monkeypatch, row_by_row):
    """The selector's hand-written backward (repeated tokens, so rows accumulate), both ways of reading the rows
    (a candidate at a time, CPU's; all at once, a GPU's), against gradcheck and against autograd through
    F.embedding and einsum, the formula it replaced."""
    monkeypatch.setattr(dflash2, "_row_by_row", lambda device, block: row_by_row)
    g = torch.Generator().manual_seed(3)
    sel = CandidateSelector(hidden_size=6, vocab_size=5, rank=4, top_k=3).double()
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    h = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    prev = torch.tensor([[0, 1, 1], [4, 0, 1]])
    cand = torch.randint(0, 5, (2, 3, 4), generator=g)
    P, S = sel.predecessor_codebook, sel.successor_codebook
    assert torch.autograd.gradcheck(lambda *_: sel.pairwise(h, prev, cand), (h, P, S))

    def reference():
        mixed = F.embedding(prev, P) * sel.hidden_projection(h)
        return torch.einsum("...r,...kr->...k", mixed, F.embedding(cand, S))

    weights = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    params = [h, P, S, sel.hidden_projection.weight]
    ours = torch.autograd.grad((sel.pairwise(h, prev, cand) * weights).sum(), params)
    theirs = torch.autograd.grad((reference() * weights).sum(), params)
    torch.testing.assert_close(sel.pairwise(h, prev, cand), reference(), rtol=1e-12, atol=1e-12)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # decoding's unbatched call (one slot: hidden [H], the predecessor a scalar) gives the slot's K scores, as does
    # its no-gradient path (no autograd Function), batched or not
    torch.testing.assert_close(sel.pairwise(h[1, 2], prev[1, 2], cand[1, 2]), reference()[1, 2], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(sel.pairwise(h, prev, cand), reference(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sel.pairwise(h[1, 2], prev[1, 2], cand[1, 2]), reference()[1, 2], rtol=1e-12,
                                   atol=1e-12)


def test_the_selector_reads_rows_one_candidate_at_a_time_only_for_blocks_larger_than_the_cache(monkeypatch):
    """A small block (one row of K candidates, with gradients) is one gather, not a loop of K reads (the loop was
    half the selector walk's time at bench dflash2's Qwen3-8B shape before decoding skipped the autograd Functions);
    a training step's thousands of rows are read a candidate at a time on CPU; other devices always gather."""
    sel = CandidateSelector(hidden_size=8, vocab_size=64, rank=256, top_k=32)
    reads = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, d, i: reads.append(i.numel()) or real(t, d, i))
    cand = torch.randint(0, 64, (32,))
    sel.pairwise(torch.randn(8), torch.tensor(3), cand)
    assert reads == [1, 32]  # the predecessor's row, then the candidates' rows at once
    rows = dflash2.ROW_BY_ROW_MIN // (32 * 256)
    assert not dflash2._row_by_row(torch.device("cpu"), 33 * 256)
    assert dflash2._row_by_row(torch.device("cpu"), rows * 32 * 256)
    assert not dflash2._row_by_row(torch.device("meta"), 10**9)


def zero_init_drafter(target, successor_init="zero"):
    """A DFlash 2 drafter for `target` built as training builds it, its backbone, convolutions and predecessor
    codebook moved off their init (so it is not DFlash, and only the successor codebook is at its init)."""
    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter

    torch.manual_seed(0)
    cfg = DrafterConfig(kind="dflash2", num_layers=1, block_size=B, selector_rank=8, selector_top_k=4)
    drafter = build_drafter(cfg, LayersConfig(ids=[1, 3]), target, successor_init=successor_init)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "successor" not in name:
                p.add_(0.3 * torch.randn_like(p))
            elif successor_init == "normal":
                p.mul_(200)  # pairwise scores that reorder the candidates: the control
    return drafter.eval()


@pytest.mark.parametrize("init", ["zero", "normal"])
def test_a_zero_initialised_successor_codebook_drafts_the_unary_argmax_chain(tiny_targets, init):
    """loss.selector.init=zero: the pairwise term is 0, so the selector's path is the argmax path, teacher-forced
    (every record's draft equals its unary tokens) and live (speculative_generate drafts, accepts and outputs what
    the same drafter without its selector does); a normal init at a scale that matters does not."""
    import copy

    from dflash.config import EvalConfig
    from dflash.drafter.decoding.engine import speculative_generate
    from dflash.evaluate.teacher_forced import teacher_forced
    from tests.evaluate.test_teacher_forced import SyntheticSet

    target = tiny_targets["tiny_qwen3"]
    drafter = zero_init_drafter(target, init)
    assert (drafter.candidate_selector.successor_codebook == 0).all() == (init == "zero")
    data = SyntheticSet([60, 45], 2 * target.config.hidden_size, target.config.vocab_size)
    records = teacher_forced(drafter, target.embed_tokens, target.lm_head, data, EvalConfig(prompts="synthetic",
                                                                                            ddtree_budgets=[]))
    same = [r["draft_tokens"] == r["unary_tokens"] for r in records]
    unary = copy.deepcopy(drafter)
    unary.candidate_selector = None  # a DFlash drafter of the same weights: it drafts its argmax
    ids = torch.randint(0, target.config.vocab_size - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = speculative_generate(drafter, target, ids, 32), speculative_generate(unary, target, ids, 32)
    if init == "zero":
        assert all(same) and len(records) > 50
        assert ours.draft_tokens == theirs.draft_tokens and ours.acceptance_lengths == theirs.acceptance_lengths
        assert torch.equal(ours.output_ids, theirs.output_ids)
    else:
        assert not all(same) and ours.draft_tokens != theirs.draft_tokens


def test_a_zero_initialised_successor_codebook_still_trains():
    """S = 0 makes the pairwise term and the gradients of P and W zero, not S's: d/dS[c] = g_c P[prev] (W h)."""
    torch.manual_seed(0)
    sel = CandidateSelector(16, 50, rank=8, top_k=4)
    torch.nn.init.zeros_(sel.successor_codebook)
    hidden, logits = torch.randn(6, 16), torch.randn(6, 50)
    labels, prev = logits.topk(4, dim=-1).indices[:, 2], torch.arange(6)
    selector_ce(sel, hidden, logits, labels, prev)[1].ce.sum().backward()
    assert sel.successor_codebook.grad.abs().sum() > 0
    assert not sel.predecessor_codebook.grad.any() and not sel.hidden_projection.weight.grad.any()


def test_the_beam_over_the_selector_maximises_the_expected_accepted_length():
    """beam_path of width 1 is the greedy walk; a beam wide enough to keep every path finds the path of the largest
    expected accepted length sum_k prod_{i<=k} q_i (brute force over all K^S paths); a narrower beam's path is never
    worse than the greedy walk's by that measure, and on some blocks better."""
    import itertools

    from dflash.drafter.dflash2 import beam_path, walk_path

    def expected(cand, first, table, path_idx):
        q, total, reach, prev = torch.softmax(first, -1), 0.0, 1.0, None
        for s, i in enumerate(path_idx):
            reach *= float((q if s == 0 else torch.softmax(table[s - 1, prev], -1))[i])
            total, prev = total + reach, i
        return total

    g = torch.Generator().manual_seed(0)
    S, K, V, better = 4, 3, 30, 0
    for _ in range(60):
        cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(S)])
        first, table = 2 * torch.randn(K, generator=g), 2 * torch.randn(S - 1, K, K, generator=g)
        assert beam_path(cand, first, table, width=1) == walk_path(cand, first, table)
        best = max(itertools.product(range(K), repeat=S), key=lambda p: expected(cand, first, table, p))
        assert beam_path(cand, first, table, width=K ** (S - 1)) == cand[torch.arange(S), torch.tensor(best)].tolist()
        index = lambda path: [int((cand[s] == t).nonzero()) for s, t in enumerate(path)]  # noqa: E731
        greedy = expected(cand, first, table, index(walk_path(cand, first, table)))
        beam = expected(cand, first, table, index(beam_path(cand, first, table, width=2)))
        assert beam >= greedy - 1e-9
        better += beam > greedy + 1e-9
    assert better > 0
    assert beam_path(cand, first, table, depth=2, width=3) == beam_path(cand[:2], first, table[:1], width=3)
