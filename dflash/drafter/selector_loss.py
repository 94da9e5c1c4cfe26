"""DFlash 2's candidate selector in training (DESIGN §2b): its K-way cross-entropy over the unary top-K
(`selector_ce`) and the choices of how it is trained (`SelectorOptions`, the loss.selector.* keys).

The loss is computed inside dflash.drafter.loss's row chunks, from the chunk's logits of the target head (the
unary scores), so the LM head runs once per row. Per row (hidden h [H], gold token y, predecessor a = the previous
gold token, the anchor at slot 1; teacher forcing): the candidates are the unary top-K, the scores
unary(c) + P[a] (W h) S[c], and the row loss is the CE of the gold token's place among them.

- gradient: `coupled` (the public trainers' default, and ours since issue 50) lets the selector's gradient reach
  the unary scores too, so the drafter's logits learn to rank what the selector needs. That gradient is K-sparse:
  `_SparseUnary` adds it into the per-slot loss's own dense logits gradient with one scatter-add, where autograd's
  gather would make a second dense [rows, V] gradient and add the two (1.8x the DFlash step on the CPU
  benchmark). `detach_unary` takes the unary scores as constants (the per-slot loss trains them; the selector
  trains the codebooks, the projection and, through it, the hidden states). `stop` detaches the hidden states
  too: the selector's loss then trains its own parameters only.
- gold: `inject` puts a gold token missing from the top-K in the K-th's place, in the loss only (speculators);
  `strict` gives such a row no loss, and its weight leaves the normaliser (SpecForge).
- dropout on the predecessor's codebook row, a regulariser of the loss only (decoding's scores have none, nor has
  the choice the metrics score).
- weights: the selector's slot weights, `decay` (exp(-(k-1)/gamma), always) or `follow` (the per-slot loss's:
  decay or D-PACE, `loss.weighting`). The loss is their weighted mean (dflash.train.step normalises it).
- shrink: the pairwise term's weight in what is served (`served_weights`, `served_selector`) and in the choice the
  metrics score; the loss keeps weight 1.
- span: the codebooks kept in the span of the target's token vectors (`CodebookSpan`, after each optimizer step).
The other selector keys act elsewhere: its weight's schedule (`schedule_weight`, read by dflash.train.step), its
gold tokens from the target (dflash.train.step.target_argmax), the successor codebook's init (build_drafter) and
the codebooks' weight decay (dflash.train.optim.build_optimizer).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash.config.model import SELECTOR_CHOICES


@dataclass(frozen=True)
class SelectorOptions:
    """How the selector's loss is formed (loss.selector.gradient, gold, dropout, weights; this module's docstring
    says what each does), and `shrink` (loss.selector.shrink) the weight of the pairwise term in the choice the
    metrics score: the served drafter's (`served_weights`)."""

    gradient: str = "coupled"
    gold: str = "inject"
    dropout: float = 0.0
    weights: str = "decay"
    shrink: float = 1.0

    def __post_init__(self) -> None:
        for name in ("gradient", "gold", "weights"):
            value, allowed = getattr(self, name), SELECTOR_CHOICES[name]
            if value not in allowed:
                raise ValueError(f"selector {name}={value!r}: one of {', '.join(allowed)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"selector dropout={self.dropout}: in [0, 1)")


class SelectorTerms(NamedTuple):
    """What `selector_ce` gives per row: the CE [N] (0 where it does not count), the choice as served [N] (the
    best of the unary top-K), the oracle [N] (the data's label where the unary top-K holds it, else -1) and
    `counted` [N] bool (the rows whose loss and weight count: all, or with gold=strict those whose gold token is
    among the top-K)."""

    ce: torch.Tensor
    choice: torch.Tensor
    oracle: torch.Tensor
    counted: torch.Tensor


class _SparseUnary(torch.autograd.Function):
    """(logits [N, V], index [N, J]) -> (logits, logits.gather(-1, index) [N, J]), the first the same tensor for
    the per-slot loss to read. Backward adds the gathered scores' gradient into the logits' own gradient with a
    scatter-add, in place: the selector's K-sparse gradient never becomes a dense [N, V] tensor of its own.

    The incoming dense gradient is the per-slot loss's (log_softmax's backward makes a fresh one, read by nothing
    else), so writing into it is safe; a non-contiguous one (an expanded zero) is copied first."""

    @staticmethod
    def forward(ctx, logits, index):
        ctx.save_for_backward(index)
        return logits.view_as(logits), logits.gather(-1, index)

    @staticmethod
    def backward(ctx, grad, grad_gathered):
        (index,) = ctx.saved_tensors
        grad = grad if grad.is_contiguous() else grad.contiguous()
        return grad.scatter_add_(-1, index, grad_gathered.to(grad.dtype)), None


def selector_ce(selector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
                gold: torch.Tensor | None = None,
                options: SelectorOptions = SelectorOptions()) -> tuple[torch.Tensor, SelectorTerms]:
    """The selector's loss on a chunk of rows: (logits, SelectorTerms).

    hidden [N, H], logits [N, V] (the unary scores), labels [N] (the data's tokens: the oracle's reference),
    prev [N] (the previous data token: the anchor at slot 1), gold [N] the tokens the CE trains towards (None =
    labels; loss.selector.labels=target gives the target's argmax). The loss's candidates are the unary top-K,
    with a missing gold token in place of the K-th (inject; with strict that row's CE is 0 and not counted); the
    scores are unary + pairwise. The choice is the best of the unary top-K alone, as decoding chooses: a gold
    token outside them is never chosen. One score per candidate, the top-K's and the gold's ([N, K + 1]), serves
    both sets.
    The returned logits are the input's values: the caller computes its per-slot loss from them, because under
    gradient=coupled they carry the selector's sparse gradient (`_SparseUnary`); otherwise they are the input.
    """
    both = _candidates(selector, logits.detach(), labels if gold is None else gold)
    if options.gradient == "coupled":
        logits, unary = _SparseUnary.apply(logits, both)
    else:
        unary = logits.detach().gather(-1, both)
    return logits, _selector_loss(selector, hidden, unary, both, labels, prev, options)


class Scored(NamedTuple):
    """`selector_scores`: the SelectorTerms, the unary scores the loss read [N, K + 1] and their token ids."""

    terms: SelectorTerms
    unary: torch.Tensor
    index: torch.Tensor


def selector_scores(selector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
                    gold: torch.Tensor | None, options: SelectorOptions, unary_leaf: bool) -> Scored:
    """`selector_ce`'s loss from logits taken as constants (the fused head loss, dflash.drafter.head_ce): the
    K + 1 unary scores it reads are gathered, and with `unary_leaf` made a leaf whose gradient the caller takes
    (gradient=coupled)."""
    both = _candidates(selector, logits, labels if gold is None else gold)
    unary = logits.gather(-1, both)
    if unary_leaf:
        unary.requires_grad_(True)
    return Scored(_selector_loss(selector, hidden, unary, both, labels, prev, options), unary, both)


def _candidates(selector, logits: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """[N, K + 1]: the unary top-K token ids, then the gold token."""
    return torch.cat([selector.candidates(logits)[1], gold[:, None]], 1)


def _selector_loss(selector, hidden, unary, both, labels, prev, options: SelectorOptions) -> SelectorTerms:
    K = both.shape[1] - 1
    cand, gold = both[:, :K], both[:, K]
    hit = cand == gold[:, None]
    held = hit.any(-1)
    h = hidden.detach() if options.gradient == "stop" else hidden
    pair = selector.pairwise(h, prev, both, dropout=options.dropout).float()
    scores = unary.float() + pair  # selector.scores: the loss trains the pairwise term at weight 1
    # the loss's K: the top-K when it holds the gold (its extra column dropped), else the gold in the K-th's place
    dropped = torch.where(held, K, K - 1)
    place = torch.where(held, hit.int().argmax(-1), K)
    ce = F.cross_entropy(scores.scatter(-1, dropped[:, None], float("-inf")), place, reduction="none")
    counted = held if options.gold == "strict" else torch.ones_like(held)
    if options.gold == "strict":
        ce = torch.where(counted, ce, torch.zeros_like(ce))
    # the choice the metrics score is the served drafter's: pairwise term times the shrink, and no dropout (decoding
    # has none; a dropped-out choice made train/tau noisy). With dropout the term is made again for the K candidates,
    # without a gradient and without a draw (the loss's masks, and a chunk's replay of them, stay as they are)
    if options.dropout > 0:
        with torch.no_grad():
            clean = selector.pairwise(h, prev, cand).float()
    else:
        clean = pair[:, :K].detach()
    served = unary[:, :K].detach().float() + options.shrink * clean
    choice = cand.gather(-1, served.argmax(-1, keepdim=True))[:, 0]
    oracle = torch.where((cand == labels[:, None]).any(-1), labels, torch.full_like(labels, -1))
    return SelectorTerms(ce, choice, oracle, counted)


def schedule_weight(step: int, total_steps: int, weight: float, warmup_ratio: float = 0.0,
                    ramp_ratio: float = 0.0) -> float:
    """The selector loss's weight at optimizer step `step` (0-based) of `total_steps`: 0 before warmup_ratio x
    total_steps, then linear from 0 to `weight` over the next ramp_ratio x total_steps, `weight` after (SpecForge's
    dflash2_selector_warmup_ratio and _ramp_ratio). Both ratios 0: `weight` throughout."""
    start, ramp = warmup_ratio * total_steps, ramp_ratio * total_steps
    if step < start:
        return 0.0
    return weight if ramp <= 0 else weight * min(1.0, (step - start) / ramp)


PREDECESSOR_KEY = "candidate_selector.predecessor_codebook"


def served_weights(state_dict: dict, shrink: float) -> dict:
    """The drafter's weights as served with loss.selector.shrink: the predecessor codebook times `shrink`, so the
    pairwise term (linear in it) is the trained one times `shrink` in the published layout, which servers read
    unchanged. Training's own copy (the float32 weights a resume reads) keeps the trained codebook."""
    if shrink == 1.0 or PREDECESSOR_KEY not in state_dict:
        return state_dict
    return {**state_dict, PREDECESSOR_KEY: state_dict[PREDECESSOR_KEY] * shrink}


@contextmanager
def served_selector(drafter, shrink: float):
    """Inside the block the drafter's predecessor codebook is `served_weights`' (in-run evaluation scores the
    drafter as it will be served); after it, the trained codebook exactly as it was."""
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None or shrink == 1.0:
        yield drafter
        return
    codebook = selector.predecessor_codebook
    kept = codebook.detach().clone()
    with torch.no_grad():
        codebook.mul_(shrink)
    try:
        yield drafter
    finally:
        with torch.no_grad():
            codebook.copy_(kept)


class CodebookSpan:
    """loss.selector.span=embedding: keeps the selector's codebooks in the span of the target's token vectors.

    A free codebook row is a token's own: it learns that token's pairs in the training answers and nothing of the
    tokens like it. Here each codebook C [V, r] stays E A for some A [H, r], E [V, H] the target's embedding table
    (predecessor) or head (successor): after every optimizer step C is replaced by its least-squares projection
    E (E^T E)^+ E^T C, so what is learnt of one token moves the tokens the target places near it. The exported
    codebooks are still [V, r] tables (the published layout): serving does not know how they were trained.
    Rows of E are read in chunks of `chunk_rows`, so no [V, H] float32 copy of a large table is made."""

    def __init__(self, selector, embedding: torch.Tensor, head: torch.Tensor | None, chunk_rows: int = 65536):
        """head None: the successor's codebook stays free (loss.selector.span=predecessor)."""
        self.chunk_rows = chunk_rows
        self.pairs = [(selector.predecessor_codebook, embedding)]
        if head is not None:
            self.pairs.append((selector.successor_codebook, head))
        self.grams = [torch.linalg.pinv(self._gram(table), hermitian=True).float() for _, table in self.pairs]
        self()

    def _chunks(self, table: torch.Tensor):
        for start in range(0, table.shape[0], self.chunk_rows):
            yield start, table[start:start + self.chunk_rows].float()

    def _gram(self, table: torch.Tensor) -> torch.Tensor:
        gram = torch.zeros(table.shape[1], table.shape[1], dtype=torch.float64, device=table.device)
        for _, rows in self._chunks(table):
            gram += rows.double().T @ rows.double()
        return gram

    @torch.no_grad()
    def __call__(self) -> None:
        for (codebook, table), gram_inv in zip(self.pairs, self.grams):
            coeff = torch.zeros(table.shape[1], codebook.shape[1], device=codebook.device)
            for start, rows in self._chunks(table):
                coeff += rows.T @ codebook[start:start + rows.shape[0]].float()
            coeff = gram_inv @ coeff
            for start, rows in self._chunks(table):
                codebook[start:start + rows.shape[0]] = (rows @ coeff).to(codebook.dtype)
