"""Speculative sampling is lossless: the text it writes is distributed exactly as the target's own sampling.

Each test draws thousands of short continuations and compares their empirical distribution with the target's
exact one (enumerated from its logits) by Pearson's chi-square test: cells whose expected count is under 5 are
pooled into one, and a test fails when its p-value is below ALPHA = 1e-3. That is each test's false-alarm rate
for a correct decoder (the seeds are fixed, so a given run either passes or fails for good); over the 17 tests
here that pass, the chance of any false alarm is at most 1.7%. Broken verifiers (the rejected draft's residual
replaced by p, the drafts verified against a q other than the one they were drawn from, a tree node that does not
remove a rejected child) must fail the same test at the same sample size.

Most tests decode a Markov-chain target (next-token logits depend on the last token only) with the real drafting
and verification code (draft_chain, draft_tree, draft_tree_pairwise, Rule.chain, the tree walk), so thousands of
draws take seconds; the drafter's slot-k logits after an anchor are the target's k-step log-marginal plus noise
(close to the target, not equal), DFlash 2's selector keeps K < V candidates (its q is zero off them). One test
runs speculative_generate itself on a tiny transformers target.
"""

import itertools
from collections import Counter

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash.drafter.decoding.rules as rules
from dflash.config import DrafterConfig, LayersConfig
from dflash.drafter.build import build_drafter
from dflash.drafter.decoding.engine import draft_chain, draft_tree, draft_tree_pairwise, speculative_generate
from dflash.drafter.decoding.rules import make_rule
from dflash.drafter.decoding.sampling import Sampling, SelectorDraw, acceptance, probs
from dflash.drafter.decoding.verify import _walk
from dflash.target.loading import as_target

ALPHA = 1e-3
V, B, K, L = 5, 4, 3, 4  # vocabulary, block size, DFlash 2 candidates, tokens generated per draw
N = 4000  # draws per test


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Pearson's chi-square p-value of the samples against the exact distribution, cells with expected count
    under 5 pooled into one."""
    counts, n = Counter(samples), len(samples)
    assert set(counts) <= {s for s, pr in exact.items() if pr > 0}, "drew a continuation the target never writes"
    kept = [s for s, pr in exact.items() if pr * n >= 5]
    observed = [counts[s] for s in kept] + [n - sum(counts[s] for s in kept)]
    expected = [exact[s] * n for s in kept] + [n - sum(exact[s] * n for s in kept)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


class Markov:
    """A target whose next-token logits depend on the last token only, and a drafter close to it."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(V, V, generator=g) * 2.0  # [previous token, next token]
        step, power, drafts = torch.softmax(self.logits, -1), torch.eye(V), []
        for _ in range(B - 1):  # slot k after anchor a: log of the target's k-step marginal, plus noise
            power = power @ step
            drafts.append(power.log() + 0.7 * torch.randn(V, V, generator=g))
        self.draft_logits = torch.stack(drafts, 1)  # [anchor, slot, V]
        unary, cand = self.draft_logits.topk(K, -1)  # DFlash 2: the top-K candidates per slot, rescored
        self.cand = cand  # [anchor, S, K]
        self.first = unary[:, 0] + 0.5 * torch.randn(V, K, generator=g)
        self.table = unary[:, 1:, None, :] + 0.5 * torch.randn(V, B - 2, K, K, generator=g)

    def rescore(self, anchor: int, slot: int, prev: int) -> torch.Tensor:
        """The selector's scores [K] at `slot` after a predecessor outside the previous slot's candidates (drawn
        over the vocabulary): the unary scores shifted by a function of that token."""
        return self.draft_logits[anchor, slot].gather(-1, self.cand[anchor, slot]) + 0.4 * torch.cos(
            torch.arange(K) + prev)

    def exact(self, sampling: Sampling, start: int) -> dict[tuple, float]:
        step = probs(self.logits, sampling)
        out = {}
        for seq in itertools.product(range(V), repeat=L):
            pr, prev = 1.0, start
            for t in seq:
                pr, prev = pr * float(step[prev, t]), t
            out[seq] = pr
        return out

    def generate(self, rule, how: str = "chain", budget: int = 4, start: int = 0) -> tuple[list[int], list[int]]:
        """(the L tokens, acceptance lengths) of one speculative decoding: `how` = chain, dflash2 (the selector's
        chain), tree (DDTree from the marginals) or pair (DDTree from the selector's pairwise scores)."""
        ids, taus = [start, rule.sample(self.logits[start], 1)], []
        while len(ids) - 1 < L:
            p, anchor = len(ids) - 1, ids[-1]
            room = L - (len(ids) - 1)
            tables = ((self.cand[anchor], self.first[anchor], self.table[anchor]) if how.startswith(("dflash2", "pair"))
                      else None)
            if how == "chain" or how.startswith("dflash2"):
                draw = SelectorDraw(how.partition("-")[2] or "candidates")
                drafts, q = draft_chain(self.draft_logits[anchor], tables, room - 1, rule, p, draw,
                                        lambda s, prev, a=anchor: self.rescore(a, s, prev))
                a, bonus = rule.chain(self.logits[[anchor] + drafts], p + 1, drafts, q)
                accepted = drafts[:a]
            else:
                tree, _ = (draft_tree(self.draft_logits[anchor], budget, room) if how == "tree" else
                           draft_tree_pairwise(tables, budget, room))
                logits_of = lambda node: self.logits[anchor if node < 0 else tree.tokens[node]][None]  # noqa: E731
                accepted, _, bonus = _walk(tree, logits_of, p, rule)
            ids += accepted + [bonus]
            taus.append(len(accepted) + 1)
        return ids[1: L + 1], taus


def draws(markov: Markov, sampling: Sampling, how: str, verifier: str = "rejection", n: int = N):
    rule = make_rule(sampling, verifier, seed=1234)
    samples, taus = [], []
    for i in range(n):
        if verifier == "seeded":  # its draws are a function of (seed, position): one seed per continuation
            rule = make_rule(sampling, verifier, seed=i)
        tokens, t = markov.generate(rule, how)
        samples.append(tuple(tokens))
        taus += t
    return samples, taus


CASES = [
    ("chain", Sampling(1.0)),
    ("chain", Sampling(0.6, top_p=0.9)),
    ("chain", Sampling(1.3, top_k=3)),
    ("dflash2", Sampling(1.0)),
    ("dflash2", Sampling(0.7, top_k=2)),
    ("dflash2-vocabulary", Sampling(1.0)),
    ("dflash2-unary", Sampling(0.8, top_p=0.9)),
    ("tree", Sampling(1.0)),
    ("tree", Sampling(0.8, top_p=0.8)),
    ("pair", Sampling(1.0)),
    ("pair", Sampling(1.2, top_k=4, top_p=0.95)),
]


@pytest.mark.parametrize("how,sampling", CASES, ids=[f"{h}-{s.describe()}" for h, s in CASES])
def test_rejection_sampling_is_lossless(how, sampling):
    markov = Markov()
    samples, taus = draws(markov, sampling, how)
    assert chi_square_pvalue(samples, markov.exact(sampling, 0)) > ALPHA
    assert sum(taus) / len(taus) > 1.3  # the drafts are accepted often: the test exercises acceptance


@pytest.mark.parametrize("verifier,how", [("seeded", "chain"), ("exact_match", "chain"), ("exact_match", "dflash2")])
def test_the_other_verifiers_are_lossless(verifier, how):
    markov, sampling = Markov(), Sampling(0.9, top_p=0.95)
    samples, _ = draws(markov, sampling, how, verifier=verifier)
    assert chi_square_pvalue(samples, markov.exact(sampling, 0)) > ALPHA


def test_exact_match_accepts_a_greedy_draft_with_the_targets_probability_of_it():
    """verifier=exact_match drafts the argmax and accepts it with probability p(argmax q), below rejection
    sampling's sum_x min(p, q) here; 4-sigma bands (false alarm 6e-5 each)."""
    markov, sampling, n = Markov(), Sampling(1.0), 6000
    p, q = probs(markov.logits[2], sampling), probs(markov.draft_logits[2, 0], sampling)
    for verifier, rate in (("exact_match", float(p[q.argmax()])), ("rejection", float(acceptance(p, q)))):
        rule, hits = make_rule(sampling, verifier, seed=3), 0
        for _ in range(n):
            drafts, dq = draft_chain(markov.draft_logits[2], None, B - 1, rule, 1)
            hits += rule.chain(markov.logits[[2] + drafts], 2, drafts, dq)[0] >= 1
        assert abs(hits / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5, verifier
    assert float(p[q.argmax()]) < float(acceptance(p, q))


def test_first_slot_accepts_with_probability_sum_of_min():
    """alpha = sum_x min(p(x), q(x)) (what teacher-forced evaluation reports at temperature) is the first
    draft's acceptance rate; a 4-sigma band (false alarm 6e-5)."""
    markov, sampling = Markov(), Sampling(1.0)
    rule = make_rule(sampling, seed=7)
    n, hits = 6000, 0
    for _ in range(n):
        p, anchor = 1, 2
        drafts, q = draft_chain(markov.draft_logits[anchor], None, B - 1, rule, p)
        hits += rule.chain(markov.logits[[anchor] + drafts], p + 1, drafts, q)[0] >= 1
    alpha = float(acceptance(probs(markov.logits[anchor], sampling), probs(markov.draft_logits[anchor, 0], sampling)))
    assert abs(hits / n - alpha) < 4 * (alpha * (1 - alpha) / n) ** 0.5


def _resample_from_p(p, q):
    return p


@pytest.mark.parametrize("how", ["chain", "dflash2"])
def test_a_rejection_that_resamples_from_p_is_caught(monkeypatch, how):
    """The classic bug: after a rejection the token is drawn from p instead of the residual max(p - q, 0)."""
    markov, sampling = Markov(), Sampling(1.0)
    monkeypatch.setattr(rules, "_residual", _resample_from_p)
    samples, _ = draws(markov, sampling, how)
    assert chi_square_pvalue(samples, markov.exact(sampling, 0)) < ALPHA


def test_verifying_against_another_q_is_caught(monkeypatch):
    """Drafts drawn from q but verified against a flatter one (q^0.5 renormalised, as if the verifier applied
    another temperature): a q that the drafts were not drawn from."""
    markov, sampling = Markov(), Sampling(1.0)
    chain = rules.Rejection.chain

    def wrong_q(self, logits, position, drafts, q):
        flat = None if q is None else q.sqrt() / q.sqrt().sum(-1, keepdim=True)
        return chain(self, logits, position, drafts, flat)

    monkeypatch.setattr(rules.Rejection, "chain", wrong_q)
    samples, _ = draws(markov, sampling, "chain")
    assert chi_square_pvalue(samples, markov.exact(sampling, 0)) < ALPHA


def test_a_tree_node_that_keeps_a_rejected_child_is_caught(monkeypatch):
    """At a tree node, a rejected child must leave the distribution the target draws from next."""
    markov, sampling = Markov(), Sampling(1.0)

    def node(self, logits, position, children):
        r = probs(logits, self.sampling)
        for i, c in enumerate(children):
            if float(torch.rand(1, generator=self.generator)) < float(r[c]):
                return i, c
        return -1, self._draw(r)

    monkeypatch.setattr(rules.Rejection, "node", node)
    samples, _ = draws(markov, sampling, "tree")
    assert chi_square_pvalue(samples, markov.exact(sampling, 0)) < ALPHA


@pytest.mark.parametrize("kind,tree_budget,sampling", [("dflash", None, Sampling(1.0)),
                                                       ("dflash2", None, Sampling(0.8, top_k=6)),
                                                       ("dflash", 4, Sampling(1.0, top_p=0.9))])
def test_speculative_generate_is_lossless_on_a_transformers_target(kind, tree_budget, sampling):
    """speculative_generate itself, on a tiny Qwen3 (16 tokens, its head scaled so its distributions are
    peaked) and a random drafter: 3 generated tokens, 600 draws (the target forward is the cost)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    target = as_target(model, mask_token_id=15)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=3, kind=kind, selector_rank=8, selector_top_k=4),
                            LayersConfig(num=2), target)
    ids, n, length = torch.tensor([[1, 2, 3]]), 600, 3
    with torch.no_grad():  # the exact distribution of the 3 tokens: every prefix's next-token distribution
        step0 = probs(model(ids).logits[0, -1], sampling)
        firsts = torch.cat([ids.repeat(16, 1), torch.arange(16)[:, None]], 1)
        step1 = probs(model(firsts).logits[:, -1], sampling)
        seconds = torch.cat([firsts.repeat_interleave(16, 0), torch.arange(16).repeat(16)[:, None]], 1)
        step2 = probs(model(seconds).logits[:, -1], sampling).view(16, 16, 16)
    exact = {(a, b, c): float(step0[a] * step1[a, b] * step2[a, b, c])
             for a, b, c in itertools.product(range(16), repeat=3)}
    samples = []
    for seed in range(n):
        res = speculative_generate(drafter, target, ids, length, temperature=sampling.temperature, top_p=sampling.top_p,
                                   top_k=sampling.top_k, tree_budget=tree_budget, seed=seed)
        samples.append(tuple(res.output_ids[0, 3:].tolist()))
    assert chi_square_pvalue(samples, exact) > ALPHA
