"""Sampling settings and the distribution they make of a row of logits: one transform for the target and the
drafter alike, live and teacher-forced.

The order is the one HF generate and vLLM apply: temperature, then top-k, then top-p (the smallest set of
most probable tokens whose mass reaches top_p, the token that crosses it included), renormalised.
Temperature 0 is greedy: the distribution is one-hot at the argmax (ties: the lowest id, as argmax).

Rejection sampling (dflash.drafter.decoding.rules) is lossless for any pair of distributions p (target) and q
(drafter) as long as the drafts are drawn from the q it is given; drafting from the same transform as the
target makes q closest to p, so it accepts the most.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dflash.config.run import SELECTOR_DRAWS


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from a row of logits."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before the softmax."""
    top_p: float = 1.0
    """Nucleus: keep the most probable tokens until their mass reaches top_p (1 = all)."""
    top_k: int = 0
    """Keep the k most probable tokens (0 = all)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: in (0, 1], 1 keeps every token")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: 0 (every token) or more")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy (temperature 0)"
        return f"temperature {self.temperature:g}, top-p {self.top_p:g}, top-k {self.top_k or 'off'}"


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution [..., V] float32 that `sampling` draws from, for logits [..., V]."""
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, -1)
    return _nucleus(p, sampling.top_p) if sampling.top_p < 1 else p


@dataclass(frozen=True)
class SelectorDraw:  # eval.decode.selector_draw and eval.decode.selector_truncation
    """How a DFlash 2 drafter draws its chain at temperature > 0 (greedy drafting is the selector's walk whatever
    this says). Rejection sampling is lossless for any q the drafts are drawn from, so each is a choice of
    acceptance, not of correctness."""

    over: str = "candidates"
    """candidates: softmax(score / T) over the unary top-K, zero elsewhere, as the z-lab reference draws (where the
    target's distribution is flatter than K tokens cover, acceptance is capped by its mass on them); vocabulary:
    softmax over every token of the unary logits with the K candidates' entries replaced by their selector scores
    (the selector's gain where it rescored, the unary head's distribution elsewhere); unary: the unary head's
    distribution alone (DFlash's drafting)."""
    truncate: bool = False
    """Apply the run's top-p / top-k to the draw too (candidates: among the K; vocabulary: over every token);
    off, only the temperature, as the reference draws."""

    def __post_init__(self) -> None:
        if self.over not in SELECTOR_DRAWS:
            raise ValueError(f"selector draw over={self.over!r}: one of {', '.join(SELECTOR_DRAWS)}")

    def sampling(self, sampling: Sampling) -> Sampling:
        """The transform of the draw's rows: `sampling` whole when truncating, else its temperature alone."""
        return sampling if self.truncate else replace(sampling, top_p=1.0, top_k=0)


def selector_rows(draw: SelectorDraw, logits: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor,
                  sampling: Sampling) -> torch.Tensor:
    """The distributions [..., V] a DFlash 2 slot is drawn from at temperature > 0 (`SelectorDraw`): logits [..., V]
    (the unary ones), scores [..., K] (the selector's, after the slot's predecessor), cand [..., K] their token
    ids."""
    rows = draw.sampling(sampling)
    if draw.over == "unary":
        return probs(logits, rows)
    if draw.over == "vocabulary":
        return probs(logits.float().scatter(-1, cand, scores.float()), rows)
    return torch.zeros(*logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, cand,
                                                                                          probs(scores, rows))


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """p [..., V] kept on its most probable tokens until their mass (out of p's total) reaches top_p, the token
    that crosses it included, renormalised."""
    sorted_p, order = p.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the more probable tokens
    drop = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, before >= top_p)
    p = p.masked_fill(drop, 0.0)
    return p / p.sum(-1, keepdim=True)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) [...]: the probability that rejection sampling accepts a draft drawn from q
    [..., V] against the target's p [..., V] (1 - their total variation distance)."""
    return torch.minimum(p, q).sum(-1)


def stored_probs(logprobs: torch.Tensor, rest: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's sampling distribution from its stored top-k (logprobs [..., k] of the k most probable tokens
    at temperature 1, rest [...] the mass of all the others): (p [..., k] on those tokens, p_rest [...] on the
    others, one bucket).

    Exact with top_k <= k at any temperature (every kept token is stored; top-p then renormalises over them
    as well), at temperature 1 with no truncation (the rest stays one bucket), and at temperature 1 with top-p
    alone when the stored mass reaches top_p (the nucleus is stored tokens only). Otherwise the tempered mass of
    the unstored tokens is unknown, and the distribution is renormalised over the k stored tokens."""
    none = torch.zeros_like(rest, dtype=torch.float32)
    if sampling.temperature == 1 and sampling.top_k == 0:
        p = logprobs.float().exp()  # the true masses: the nucleus is measured out of 1, not out of the k tokens
        return (p, rest.float()) if sampling.top_p >= 1 else (_nucleus(p, sampling.top_p), none)
    return probs(logprobs, sampling), none


def stored_acceptance(q: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, p_rest: torch.Tensor) -> torch.Tensor:
    """alpha [...] of a draft from q [..., V] against the target's stored distribution (`stored_probs`: p [..., k]
    on token ids [..., k], p_rest on the others, one bucket): sum_i min(p_i, q(id_i)) + min(p_rest, q_rest).
    With a bucket this is an upper bound of the exact alpha (coarsening can only merge overlap)."""
    q_top = q.gather(-1, ids)
    return torch.minimum(p, q_top).sum(-1) + torch.minimum(p_rest, (1 - q_top.sum(-1)).clamp_min(0))
