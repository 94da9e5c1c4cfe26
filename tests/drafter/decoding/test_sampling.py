"""The sampling transform (temperature, top-k, top-p) and the acceptance rates made from it."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash.drafter.decoding.sampling import Sampling, acceptance, probs, stored_acceptance, stored_probs


def hf_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """What HF generate samples from with do_sample=True: temperature, then top-k, then top-p."""
    scores = TemperatureLogitsWarper(s.temperature)(None, logits.clone())
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.6), Sampling(1.5, top_k=5), Sampling(0.8, top_p=0.9),
                               Sampling(1.2, top_k=12, top_p=0.7), Sampling(1.0, top_p=0.05)])
def test_the_transform_is_what_hf_generate_samples_from(s):
    torch.manual_seed(0)
    logits = torch.randn(64, 40) * 3
    assert torch.allclose(probs(logits, s), hf_probs(logits, s), atol=1e-6)


def test_greedy_is_one_hot_at_the_argmax_and_bad_settings_are_refused():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert probs(logits, Sampling()).tolist() == [[0, 1, 0], [1, 0, 0]]
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_top_p_keeps_the_token_that_crosses_the_mass():
    p = probs(torch.tensor([0.5, 0.3, 0.2]).log(), Sampling(1.0, top_p=0.6))  # 0.5 < 0.6: 0.3 crosses it
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0]))


def test_acceptance_is_one_minus_total_variation():
    torch.manual_seed(1)
    p, q = torch.softmax(torch.randn(8, 30), -1), torch.softmax(torch.randn(8, 30), -1)
    assert torch.allclose(acceptance(p, q), 1 - 0.5 * (p - q).abs().sum(-1))
    assert torch.allclose(acceptance(p, p), torch.ones(8))


def test_stored_distributions_are_exact_where_they_can_be_and_bound_alpha_where_not():
    torch.manual_seed(2)
    target, drafter = torch.randn(6, 50) * 2, torch.randn(6, 50) * 2
    logp = torch.log_softmax(target, -1)
    for k in (50, 10):
        top = logp.topk(k, -1)
        rest = 1 - top.values.exp().sum(-1)
        assert (top.values.exp().sum(-1) > 0.5).all()  # the nucleus of top-p 0.5 is stored tokens only
        for s in (Sampling(1.0), Sampling(0.7, top_k=4), Sampling(1.0, top_p=0.5), Sampling(1.0, top_k=8, top_p=0.6)):
            p, p_rest = stored_probs(top.values, rest, s)
            q = probs(drafter, s)
            exact = acceptance(probs(target, s), q)
            stored = stored_acceptance(q, top.indices, p, p_rest)
            if k == 50 or s.top_k or s.top_p < 1:  # the whole vocabulary, or a truncation inside the stored k
                assert torch.allclose(stored, exact, atol=1e-5), (k, s)
            else:  # one bucket for the other 40 tokens: never below the exact alpha
                assert (stored >= exact - 1e-6).all() and not torch.allclose(stored, exact)
