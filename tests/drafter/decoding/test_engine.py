"""Live speculative decoding is lossless on attention-only and hybrid targets."""

import pytest
import torch

from dflash.config import DrafterConfig, LayersConfig
from dflash.drafter.build import build_drafter
from dflash.drafter.decoding.engine import OFF, Clock, greedy_generate, speculative_generate
from tests.oracle import OracleDrafter


def prompt(seed=0, n=10):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tree_budget", [None, 6])
def test_lossless_with_partial_acceptance(tiny_target, tree_budget):
    ids = prompt()
    plain = greedy_generate(tiny_target, ids, 60)
    # sharp: a DDTree of 6 nodes then holds the drafted path (a flat one would be wide and shallow)
    oracle = OracleDrafter(tiny_target, plain[0].tolist(), wrong=lambda p, k: (p * 7 + k) % 5 == 0, scale=5000.0)
    assert oracle.check_head()
    res = speculative_generate(oracle, tiny_target, ids, 60, tree_budget=tree_budget)
    assert torch.equal(res.output_ids, plain)
    taus = res.acceptance_lengths
    assert 1 + sum(taus) == 60  # the prefill makes the first token
    assert max(taus) > 2 and min(taus) < 8 and all(1 <= t <= 8 for t in taus)
    assert res.target_forwards == 1 + len(taus)  # one forward a block, no replay on the hybrid target either


def test_drafts_never_accepted_give_one_token_per_target_forward(tiny_target):
    """The prompt's forward counts: a drafter that is always wrong is plain decoding, 1.0 tokens per forward."""
    ids = prompt(4)
    plain = greedy_generate(tiny_target, ids, 20)
    res = speculative_generate(OracleDrafter(tiny_target, plain[0].tolist(), wrong=lambda p, k: True), tiny_target,
                               ids, 20)
    assert torch.equal(res.output_ids, plain) and set(res.acceptance_lengths) == {1}
    assert res.target_forwards == 1 + len(res.acceptance_lengths)
    assert (res.output_ids.shape[1] - ids.shape[1]) / res.target_forwards == 1.0


def test_perfect_drafts_commit_whole_blocks(tiny_target):
    ids = prompt(1)
    plain = greedy_generate(tiny_target, ids, 40)
    res = speculative_generate(OracleDrafter(tiny_target, plain[0].tolist()), tiny_target, ids, 40)
    assert torch.equal(res.output_ids, plain)
    assert res.acceptance_lengths == [8, 8, 8, 8, 7] and res.target_forwards == 6  # 1 + 39 tokens


def test_tree_recovers_drafts_the_single_path_misses(tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    ids = prompt(2)
    plain = greedy_generate(target, ids, 48)
    oracle = OracleDrafter(target, plain[0].tolist(), wrong=lambda p, k: k == 3, scale=5000.0)
    single = speculative_generate(oracle, target, ids, 48)
    tree = speculative_generate(oracle, target, ids, 48, tree_budget=16)
    assert torch.equal(single.output_ids, plain) and torch.equal(tree.output_ids, plain)
    assert max(single.acceptance_lengths) <= 3
    assert sum(tree.acceptance_lengths) / len(tree.acceptance_lengths) >= sum(single.acceptance_lengths) / len(
        single.acceptance_lengths)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_seeded_sampling_matches_plain_sampling_token_for_token(tiny_target, kind):
    """verifier="seeded": at temperature the drafts (DFlash 2: drawn from its selector's distribution over the
    candidates) are verified against the target's seeded draws: the output is plain sampling's."""
    ids = prompt(3)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4, kind=kind, selector_rank=16),
                            LayersConfig(num=2), tiny_target)
    plain = greedy_generate(tiny_target, ids, 30, temperature=0.8, seed=5)
    res = speculative_generate(drafter, tiny_target, ids, 30, temperature=0.8, seed=5, verifier="seeded")
    assert torch.equal(res.output_ids, plain)
    assert not torch.equal(plain, greedy_generate(tiny_target, ids, 30))


def test_stops_at_a_stop_token(tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    ids = prompt(4)
    plain = greedy_generate(target, ids, 30)
    stop = plain[0, ids.shape[1] + 11].item()
    first = (plain[0, ids.shape[1]:] == stop).nonzero()[0].item()
    res = speculative_generate(OracleDrafter(target, plain[0].tolist()), target, ids, 30, stop_token_ids=[stop])
    assert res.output_ids[0, -1].item() == stop and res.output_ids.shape[1] == ids.shape[1] + first + 1
    assert 1 + sum(res.acceptance_lengths) == first + 1  # the drafts accepted past the stop token are not counted
    assert torch.equal(greedy_generate(target, ids, 30, stop_token_ids=[stop]), res.output_ids)


def test_plain_hf_model_is_accepted_as_target(tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4), LayersConfig(num=2), target)
    res = speculative_generate(drafter, target.model, prompt(5), 12)
    assert res.output_ids.shape[1] == 22 and all(1 <= t <= 4 for t in res.acceptance_lengths)


def tiny_qwen3(**overrides):
    """A random-weight Qwen3 built in-process (attention implementation and layer types as given)."""
    from transformers import AutoModelForCausalLM

    from dflash.target.builtin import tiny_qwen3_config
    from dflash.target.loading import as_target

    config = tiny_qwen3_config(300)
    attn = overrides.pop("attn_implementation", "sdpa")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    return as_target(model, mask_token_id=0)


def test_sliding_window_target_decodes_losslessly():
    """Verification runs past the window and rejected drafts are cropped again: the cache must give
    back exactly what plain decoding (and a cache-free forward) sees."""
    from dflash.target.features import target_forward

    target = tiny_qwen3(layer_types=["sliding_attention"] * 8, sliding_window=6, use_sliding_window=True)
    ids = prompt(6, 10)
    plain = greedy_generate(target, ids, 40)
    seq = ids
    for _ in range(40):  # no cache at all: the window is the model's mask alone
        nxt = target_forward(target, seq, [], logits_to_keep=1).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], 1)
    assert torch.equal(plain, seq)
    oracle = OracleDrafter(target, plain[0].tolist(), wrong=lambda p, k: (p * 7 + k) % 5 == 0)
    res = speculative_generate(oracle, target, ids, 40)
    assert torch.equal(res.output_ids, plain) and max(res.acceptance_lengths) > 2


@pytest.mark.parametrize("tree_budget,tree", [(None, "marginal"), (6, "marginal"), (6, "pairwise")])
def test_dflash2_drafts_its_selector_path_losslessly(tiny_target, tree_budget, tree):
    """A DFlash 2 drafter drafts the selector's path (not the argmax one) and its pairwise trees; the output is
    plain greedy decoding token for token, one target forward a block."""
    ids = prompt(2)
    plain = greedy_generate(tiny_target, ids, 48)
    oracle = OracleDrafter(tiny_target, plain[0].tolist(), wrong=lambda p, k: (p * 7 + k) % 5 == 0, scale=5000.0,
                           selector_scale=3.0)
    res = speculative_generate(oracle, tiny_target, ids, 48, tree_budget=tree_budget, tree=tree)
    assert torch.equal(res.output_ids, plain)
    assert res.target_forwards == 1 + len(res.acceptance_lengths) and max(res.acceptance_lengths) > 1
    if tree_budget is None:  # the selector overrules the oracle's argmax (the DFlash 1 oracle's drafts) now and then
        unary = OracleDrafter(tiny_target, plain[0].tolist(), wrong=lambda p, k: (p * 7 + k) % 5 == 0, scale=5000.0)
        assert speculative_generate(unary, tiny_target, ids, 48).draft_tokens[0] != res.draft_tokens[0]


def test_a_pairwise_tree_needs_a_dflash2_drafter(tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    oracle = OracleDrafter(target, list(range(40)))
    with pytest.raises(ValueError, match="DFlash 2's selector"):
        speculative_generate(oracle, target, prompt(), 8, tree_budget=4, tree="pairwise")


def test_dflash2_draws_among_its_candidates_from_the_tempered_scores_alone_unless_asked():
    """At temperature > 0 the reference decoder draws a DFlash 2 slot from softmax(score / T) over the K candidates:
    top_p / top_k are not applied to them (they were: a top-p of 0.5 kept one or two candidates), unless
    selector_truncation asks for it; the drafts' q is the distribution they were drawn from either way."""
    from dflash.drafter.decoding.engine import draft_chain
    from dflash.drafter.decoding.rules import make_rule
    from dflash.drafter.decoding.sampling import Sampling, SelectorDraw, probs

    g = torch.Generator().manual_seed(0)
    S, K, V = 3, 4, 9
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(S)])
    first, table = torch.randn(K, generator=g), torch.randn(S - 1, K, K, generator=g)
    sampling = Sampling(0.8, top_p=0.5, top_k=2)
    rule = make_rule(sampling, "rejection", seed=1)
    drafts, q = draft_chain(torch.randn(S, V, generator=g), (cand, first, table), S, rule, 5)
    assert torch.allclose(q[0, cand[0]], torch.softmax(first / 0.8, -1))
    assert (q[0] > 0).sum() == K and torch.allclose(q.sum(-1), torch.ones(S))
    drafts, q = draft_chain(torch.randn(S, V, generator=g), (cand, first, table), S, rule, 5, SelectorDraw(truncate=True))
    assert torch.allclose(q[0, cand[0]], probs(first, sampling)) and (q[0] > 0).sum() <= 2


def test_dflash2_draws_over_the_vocabulary_or_its_unary_head_when_asked():
    """eval.decode.selector_draw: vocabulary draws slot 1 from softmax over every token of the unary logits with the K
    candidates' entries replaced by their scores (nonzero everywhere); unary from the unary head alone, as DFlash
    draws; a draft outside the previous slot's candidates is rescored, not read from the tables."""
    from dflash.drafter.decoding.engine import draft_chain
    from dflash.drafter.decoding.rules import make_rule
    from dflash.drafter.decoding.sampling import Sampling, SelectorDraw, probs

    g = torch.Generator().manual_seed(1)
    S, K, V = 3, 2, 6
    logits = torch.randn(S, V, generator=g)
    cand = logits.topk(K, -1).indices
    first, table = torch.randn(K, generator=g), torch.randn(S - 1, K, K, generator=g)
    rule, seen = make_rule(Sampling(1.0), "rejection", seed=2), []

    def rescore(slot, prev):
        seen.append((slot, prev))
        return torch.full((K,), float(prev))

    for _ in range(40):
        drafts, q = draft_chain(logits, (cand, first, table), S, rule, 0, SelectorDraw("vocabulary"), rescore)
        assert torch.allclose(q[0], torch.softmax(logits[0].scatter(-1, cand[0], first), -1)) and (q[0] > 0).all()
        if drafts[0] not in cand[0].tolist():  # the second slot's scores came from rescore, after that token
            assert (1, drafts[0]) in seen and torch.allclose(q[1, cand[1]], torch.softmax(
                logits[1].scatter(-1, cand[1], torch.full((K,), float(drafts[0]))), -1)[cand[1]])
    assert seen  # some draws fell outside the candidates
    drafts, q = draft_chain(logits, (cand, first, table), S, rule, 0, SelectorDraw("unary"))
    assert torch.allclose(q, probs(logits, Sampling(1.0)))


@pytest.mark.parametrize("tree_budget", [None, 6])
def test_a_clock_times_each_part_of_a_decoding_once_a_step(tiny_target, tree_budget):
    """One prefill, then a draft and a verification lap a block; plain decoding: one lap a one-token forward. The
    output is the same with a clock as without."""
    ids = prompt(3)
    plain_clock, clock = Clock(ids.device), Clock(ids.device)
    plain = greedy_generate(tiny_target, ids, 30, clock=plain_clock)
    assert plain_clock.counts == {"prefill": 1, "decode": 29}
    oracle = OracleDrafter(tiny_target, plain[0].tolist(), wrong=lambda p, k: (p * 7 + k) % 5 == 0, scale=5000.0)
    res = speculative_generate(oracle, tiny_target, ids, 30, tree_budget=tree_budget, clock=clock)
    assert torch.equal(res.output_ids, plain)
    steps = len(res.acceptance_lengths)
    assert clock.counts["prefill"] == 1 and clock.counts["draft"] == clock.counts["verify"] == steps
    assert set(clock.seconds) == {"prefill", "draft", "verify", "other"} and min(clock.seconds.values()) >= 0


def test_only_a_clock_on_cuda_synchronises(monkeypatch):
    """Timing asynchronous kernels needs the device waited for at each lap; decoding nobody times (no clock: OFF) and
    a CPU's never wait."""
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    for clock in (OFF, Clock("cpu"), Clock(None)):
        clock.start()
        clock.lap("draft")
    assert waits == [] and OFF.seconds == {}
    clock = Clock("cuda")
    clock.start()
    clock.lap("verify")
    assert len(waits) == 2 and clock.counts == {"verify": 1}
