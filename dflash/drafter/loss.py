"""The drafter's loss over block slots, chunked over rows so the full [blocks x B x vocab] logits never exist at
once (forward or backward).

Per labelled slot k (1 <= k < B; slot 0 is the given token and never counts) a row loss l_k, weighted:
- decay_ce: l_k = CE(drafter, label), w_k = exp(-(k-1)/gamma) (the DFlash paper, Eq. 4);
- dpace: l_k = CE, w_k the D-PACE weight (`dpace_weights`, arXiv 2605.18810), computed without gradient from
  the drafter's own probability of the labels in the same forward;
- kl: l_k = KL(p_target || q_drafter) at the label's position, weighted by either;
- tv: l_k = 1 - alpha_k, nla: l_k = -log alpha_k, weighted by either, where alpha_k = sum_x min(p(x), q(x))
  = 1 - TV(p, q) is the slot's acceptance rate under speculative (rejection) sampling, p and q the target's and
  the drafter's distributions at temperature T (`log_acceptance`);
- expected_tau: per block, (labelled slots) - sum_k prod_{j<=k} alpha_j, the expected number of labelled slots
  not accepted, i.e. -E[accepted length] up to a constant (`expected_rejections`); no slot weights, one count
  per block with a label.
The caller divides the weighted sum by a normaliser (the sum of the weights, or the count of valid anchors) taken
over a whole optimizer step on all processes, so accumulation and DDP stay exact (dflash.train.step).

DFlash 2 adds the candidate selector's K-way cross-entropy (dflash.drafter.selector_loss), computed from the same
chunk of logits (the LM head runs once per row), weighted by its slot weights and returned apart (`LossTerms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.drafter.head_ce import fused_head_ce, fused_head_selector_ce, weighted_ce_sum
from dflash.drafter.model import Scales
from dflash.drafter.selector_loss import SelectorOptions, selector_ce


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights: slot 0 (the given token) 0, slot k >= 1 exp(-(k-1)/gamma)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
    """float32 logits [N, V] of hidden [N, H] through the target head `weight` [V, H], with the target's output
    multiplier and softcap (`scales`: the drafter's, Scales.logits as evaluation and decoding make them; None =
    none)."""
    return (scales or Scales()).logits(hidden, weight)


def _chunk_ce(hidden, weight, labels, row_weight, selector=None, prev=None, sel_weight=None, gold=None,
              options=SelectorOptions(), *, scales=None):
    logits = head_logits(hidden, weight, scales)
    if selector is None:
        return weighted_ce_sum(logits, labels, row_weight), logits.argmax(-1)
    logits, sel = selector_ce(selector, hidden, logits, labels, prev, gold, options)  # first: coupled's logits
    return (weighted_ce_sum(logits, labels, row_weight), logits.argmax(-1), (sel.ce * sel_weight).sum(), sel.choice,
            sel.oracle, sel.counted)


def weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                row_weight: torch.Tensor, chunk_logits: int = 0, selector=None, prev: torch.Tensor | None = None,
                sel_weight: torch.Tensor | None = None, scales=None, gold: torch.Tensor | None = None,
                options: SelectorOptions = SelectorOptions(), fused: bool = True) -> tuple:
    """Sum of row_weight * CE(lm_head(hidden), labels) and the argmax predictions (logits: `head_logits`).

    hidden: [N, H]; labels, row_weight: [N]. When N x vocab exceeds chunk_logits (> 0), the
    logits are made chunk by chunk of rows, so peak memory holds one chunk's logits instead of N x vocab: with
    `fused` (loss.fused_ce), each chunk's gradients (the selector's too) are made in the forward
    (dflash.drafter.head_ce); else the chunks are recomputed in backward (activation checkpointing). Below it
    they are made at once (no recompute). Returns (loss_sum, predictions [N]); with a selector (prev, sel_weight,
    gold [N], options: `selector_ce`) also the selector's weighted CE sum, its choices [N], the oracle [N] and the
    rows it counts [N] from the same logits.
    """
    chunk_rows = max(1, chunk_logits // lm_head_weight.shape[0]) if chunk_logits > 0 else hidden.shape[0]
    sel = {} if selector is None else {"selector": selector, "options": options}
    if hidden.shape[0] <= chunk_rows:
        return _chunk_ce(hidden, lm_head_weight, labels, row_weight, prev=prev, sel_weight=sel_weight, gold=gold,
                         **sel, scales=scales)
    if fused and not lm_head_weight.requires_grad:
        logits_fn = lambda h, w: head_logits(h, w, scales)  # noqa: E731
        if selector is None:
            return fused_head_ce(hidden, lm_head_weight, labels, row_weight, chunk_rows, logits_fn)
        return fused_head_selector_ce(hidden, lm_head_weight, labels, row_weight, chunk_rows, logits_fn, selector,
                                      prev, sel_weight, gold, options, scales)
    n = len(labels.split(chunk_rows))
    split = lambda t: [None] * n if t is None else t.split(chunk_rows)  # noqa: E731
    parts = []
    # split, not per-chunk slices: a slice's backward writes a zero gradient the size of all of `hidden`
    for h, y, w, a, sw, g in zip(hidden.split(chunk_rows), labels.split(chunk_rows), row_weight.split(chunk_rows),
                                 split(prev), split(sel_weight), split(gold)):
        parts.append(checkpoint(_chunk_ce, h, lm_head_weight, y, w, prev=a, sel_weight=sw, gold=g, **sel,
                                scales=scales, use_reentrant=False))
    return tuple(torch.stack(p).sum() if p[0].dim() == 0 else torch.cat(p) for p in zip(*parts))


@dataclass
class LossTerms:
    """What `block_terms` returns: the per-slot loss's weighted sum, its weight sum (no gradient) and the argmax
    predictions [..., B] (-1 where there is no label); for DFlash 2 also the selector's CE weighted by its slot
    weights, the sum of the weights of the rows it counts (no gradient), the selector's choices among the unary
    top-K [..., B] (previous gold token as predecessor) and the oracle's [..., B] (the label where the unary top-K
    holds it, else -1)."""

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    predictions: torch.Tensor
    selector_sum: torch.Tensor | None = None
    selector_weight_sum: torch.Tensor | None = None
    selector_predictions: torch.Tensor | None = None
    oracle_predictions: torch.Tensor | None = None


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
               label_mask: torch.Tensor, gamma: float, chunk_logits: int = 0, rows: torch.Tensor | None = None,
               **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_sum, weight_sum, predictions) of `block_terms` (its arguments; no selector)."""
    terms = block_terms(hidden, lm_head_weight, labels, label_mask, gamma, chunk_logits, rows, **options)
    return terms.loss_sum, terms.weight_sum, terms.predictions


OBJECTIVES = ("ce", "kl", "tv", "nla", "expected_tau")
ACCEPTANCE = ("tv", "nla", "expected_tau")  # the objectives made of the acceptance rates alpha


def _objective(objective: str | None, soft: bool, temperature: float) -> str:
    """The row objective block_terms and row_losses run (None: kl with a target distribution, else ce)."""
    objective = objective or ("kl" if soft else "ce")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: one of {', '.join(OBJECTIVES)}")
    if soft != (objective != "ce"):
        raise ValueError(f"objective={objective} {'takes no' if soft else 'needs the'} target distribution "
                         f"(target_logits or target_topk)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if temperature != 1 and objective not in ACCEPTANCE:
        raise ValueError(f"temperature={temperature} applies to {', '.join(ACCEPTANCE)}, not {objective}")
    return objective


def block_terms(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                label_mask: torch.Tensor, gamma: float, chunk_logits: int = 0, rows: torch.Tensor | None = None, *,
                weighting: str = "decay", alpha: float = 0.5, target_logits: torch.Tensor | None = None,
                target_topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                selector=None, objective: str | None = None, temperature: float = 1.0, scales=None,
                selector_options: SelectorOptions = SelectorOptions(),
                selector_labels: torch.Tensor | None = None, fused_ce: bool = True) -> LossTerms:
    """The DFlash loss terms over packed blocks.

    hidden: [..., B, H] drafter outputs; labels/label_mask: [..., B]. Only rows with a label
    go through the LM head. Returns LossTerms: loss_sum, weight_sum, predictions [..., B] (-1 where
    there is no label); with the paper's normalisation the loss is loss_sum / weight_sum, i.e.
    sum_k w_k l_k / sum_k w_k over labelled slots. The caller divides, so that it can use the
    normaliser of a whole optimizer step across processes and micro-batches (exact distributed
    equivalence). weight_sum carries no gradient.
    rows: [N] those labelled rows' flat indices, `label_rows(label_mask)`, when the caller made them on the
    host: made here from a device mask, their count is read back (a host sync).
    weighting: decay (w_k = exp(-(k-1)/gamma)) or dpace (`dpace_weights` with `alpha`; gamma unused).
    target_logits: [N, V] the target's logits predicting each labelled row's token (`label_logits`): given,
    the row loss is KL(softmax(target) || softmax(drafter)) instead of CE on the label (or `objective`'s).
    target_topk: (logprobs [N, k], ids [N, k], rest [N]) the target's stored top-k distribution instead
    (features.topk_logits): the row loss is the KL between the two distributions coarsened to those k tokens
    and one bucket for all the others (exact when k = vocab; below, a lower bound of the full KL); the
    acceptance objectives' alpha as `log_acceptance_topk`.
    objective: ce (the label's cross-entropy; no target distribution given) or, against the target's
    distribution (target_logits or target_topk given), kl, tv (row loss 1 - alpha), nla (-log alpha), these
    weighted by `weighting`, or expected_tau (per block `expected_rejections`; no slot weights: weighting must
    be decay, and weight_sum is the count of blocks with a label); None = kl with a target distribution, else ce.
    temperature: T > 0 of the acceptance objectives' distributions softmax(logits / T) (1 for ce and kl).
    selector: a DFlash 2 CandidateSelector: its CE (`selector_ce`, predecessor = the previous slot's label, the
    anchor token at slot 1) from the same logits, weighted by the decay weights exp(-(k-1)/gamma) or with
    selector_options.weights=follow by the per-slot loss's (`weighting`); selector_options: the rest of how it is
    trained (dflash.drafter.selector_loss); selector_labels: [N] the tokens its CE trains towards at the labelled
    rows (None = the labels).
    scales: the drafter's Scales (its target's output multiplier and softcap on every logit; `head_logits`).
    fused_ce: the chunked decay CE (and the selector's) makes each chunk's gradients in the forward (`weighted_ce`).
    """
    objective = _objective(objective, target_logits is not None or target_topk is not None, temperature)
    rows = label_rows(label_mask) if rows is None else rows
    decay = (slot_weights(labels.shape[-1], gamma).to(hidden.device, non_blocking=True) * label_mask).reshape(-1)
    flat_h = hidden.reshape(-1, hidden.shape[-1])[rows]
    flat_y = labels.reshape(-1)[rows]
    sel = {}
    if selector is not None:  # slot k's predecessor is slot k-1's label (slot 0's is the anchor token)
        sel = {"selector": selector, "prev": torch.roll(labels, 1, -1).reshape(-1)[rows], "gold": selector_labels,
               "options": selector_options}
    if weighting == "decay" and objective == "ce":  # the paper's loss, unchanged
        out = weighted_ce(flat_h, lm_head_weight, flat_y, decay[rows], chunk_logits,
                          **({**sel, "sel_weight": decay[rows]} if sel else {}), scales=scales, fused=fused_ce)
        terms = LossTerms(out[0], decay.sum(), _scatter_predictions(labels, rows, out[1]))
        if sel:
            _selector_terms(terms, labels, rows, decay, out[2], *out[3:], selector_options)
        return terms
    if weighting not in ("decay", "dpace"):
        raise ValueError(f"weighting={weighting!r}: decay or dpace")
    if objective == "expected_tau" and weighting != "decay":
        raise ValueError(f"weighting={weighting}: objective=expected_tau has no slot weights (leave it at decay)")
    out = row_losses(flat_h, lm_head_weight, flat_y, chunk_logits, target_logits, target_topk, **sel,
                     objective=objective, temperature=temperature, scales=scales)
    row_loss, ce, pred = out[:3]
    w = decay  # expected_tau's selector (weighting decay)
    if objective == "expected_tau":  # row_loss holds each row's alpha; unlabelled slots' stay 0
        rates = torch.zeros(labels.numel(), dtype=row_loss.dtype, device=hidden.device).index_put((rows,), row_loss)
        terms = LossTerms(expected_rejections(rates.view(labels.shape), label_mask).sum(),
                          label_mask.any(-1).sum().float(), _scatter_predictions(labels, rows, pred))
    else:
        if weighting == "dpace":
            q = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
            q[rows] = torch.exp(-ce.detach().float())
            w = dpace_weights(q.view(labels.shape), label_mask, alpha).reshape(-1)
        terms = LossTerms((row_loss * w[rows]).sum(), w.sum(), _scatter_predictions(labels, rows, pred))
    if sel:
        sel_w = w if selector_options.weights == "follow" else decay
        _selector_terms(terms, labels, rows, sel_w, (out[3] * sel_w[rows]).sum(), *out[4:], selector_options)
    return terms


def _selector_terms(terms: LossTerms, labels, rows, weights, selector_sum, choice, oracle, counted,
                    options: SelectorOptions) -> None:
    """Fill the selector's fields of `terms`: its weighted sum, the weight of the rows it counts (all with
    gold=inject, a host-known sum for decay weights; with strict those whose gold is among the candidates), its
    choices and the oracle's, scattered to [..., B]. weights: [labels.numel()] the selector's slot weights."""
    terms.selector_sum = selector_sum
    terms.selector_weight_sum = (weights.sum() if options.gold == "inject" else
                                 (weights[rows] * counted).sum()).detach()
    terms.selector_predictions = _scatter_predictions(labels, rows, choice)
    terms.oracle_predictions = _scatter_predictions(labels, rows, oracle)


def expected_rejections(alpha: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """[...] per block, the expected number of labelled slots a verifier does not accept: (labelled slots) -
    sum_{k=1}^{B-1} prod_{j=1}^{k} alpha_j, from each slot's acceptance rate alpha [..., B] and label_mask
    [..., B]. The sum is E[tau] - 1 (slot k is accepted when slots 1..k all are; the bonus token is the 1), so
    the loss has -E[tau]'s gradient, is >= 0 and is 0 for a drafter accepted everywhere. An unlabelled slot
    counts as alpha = 0: nothing past the completion is accepted (slot 0, the given token, is never scored)."""
    mask = label_mask[..., 1:].bool()
    reach = torch.cumprod(torch.where(mask, alpha[..., 1:], torch.zeros_like(alpha[..., 1:])), dim=-1)
    return mask.sum(-1).to(alpha.dtype) - reach.sum(-1)


def _scatter_predictions(labels: torch.Tensor, rows: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    predictions = torch.full(labels.shape, -1, dtype=torch.long, device=labels.device)
    predictions.view(-1)[rows] = pred
    return predictions


def dpace_weights(q: torch.Tensor, label_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [..., B] (arXiv 2605.18810, Eqs. 7-8), without gradient.

    q: [..., B] the drafter's probability of each slot's label, exp(-CE); label_mask: [..., B].
    Smoothed confidence q~_i = (1 - alpha) q_i + alpha (Eq. 7), and for slot j

        w_j = sum_{m >= j} prod_{i <= m} q~_i        (Eq. 8)

    the expected number of accepted tokens from slot j on (slot m is accepted when slots 1..m all are), so a
    slot weighs as much as the acceptance length it can still unlock. Slot 0 (no label) and masked slots
    neither weigh (w = 0) nor count: their q~ is 1 in the products and their terms are left out of the sums.
    alpha = 1 gives w_j = number of labelled slots >= j.
    """
    with torch.no_grad():
        mask = label_mask.to(q.dtype)
        smoothed = torch.where(label_mask.bool(), (1 - alpha) * q + alpha, torch.ones_like(q))
        reach = torch.cumprod(smoothed, dim=-1) * mask  # prod_{i<=m} q~_i of labelled slots m
        return reach.flip(-1).cumsum(-1).flip(-1) * mask


def log_acceptance(logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0,
                   logq: torch.Tensor | None = None) -> torch.Tensor:
    """[N] log alpha, alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), p = softmax(target_logits / T) and q =
    softmax(logits / T) over [N, V]: the probability that speculative sampling accepts the drafter's token
    (accepted with probability min(1, p/q)). In log space (logsumexp of the minimum of the log-probabilities),
    so -log alpha stays finite and keeps its gradient however small alpha is. logq: log_softmax(logits) when
    the caller has it (used at T = 1: one [N, V] pass fewer)."""
    logp = F.log_softmax(target_logits.float() / temperature, dim=-1)
    if logq is None or temperature != 1:
        logq = F.log_softmax(logits.float() / temperature, dim=-1)
    return torch.logsumexp(torch.minimum(logp, logq), dim=-1)


def log_acceptance_topk(logits: torch.Tensor, top_logprobs: torch.Tensor, top_ids: torch.Tensor,
                        top_rest: torch.Tensor, temperature: float = 1.0,
                        logq: torch.Tensor | None = None) -> torch.Tensor:
    """[N] log alpha from the target's stored top-k (logprobs [N, k] at T = 1, ids [N, k], rest [N] the mass
    outside them) and the drafter's logits [N, V].

    T = 1: alpha of the two distributions coarsened to (the k tokens, one bucket for all others), sum_i
    min(p_i, q_i) + min(p_rest, q_rest): exact when the k tokens are the vocabulary; below, an upper bound of
    the full alpha (coarsening cannot increase the total variation).
    T != 1: the cache holds no tempered rest mass, so both distributions are the k tokens' alone, tempered and
    renormalised over them (softmax(logprobs / T), softmax(logits[ids] / T)), and the rest bucket is dropped:
    exact in the limit where the k tokens hold all the tempered mass of both, an approximation otherwise.
    logq: log_softmax(logits) when the caller has it (T = 1).
    """
    lp = top_logprobs.float()
    if temperature != 1:
        logp = F.log_softmax(lp / temperature, dim=-1)
        logq = F.log_softmax(logits.float().gather(-1, top_ids) / temperature, dim=-1)
        return torch.logsumexp(torch.minimum(logp, logq), dim=-1)
    logq = F.log_softmax(logits.float(), dim=-1) if logq is None else logq
    log_q_rest = torch.logsumexp(logq.scatter(-1, top_ids, -1e4), dim=-1)  # see _chunk_rows
    log_p_rest = torch.log(top_rest.float().clamp_min(1e-30))
    both = torch.cat([torch.minimum(lp, logq.gather(-1, top_ids)), torch.minimum(log_p_rest, log_q_rest)[:, None]],
                     dim=-1)
    return torch.logsumexp(both, dim=-1)


def _chunk_rows(hidden, weight, labels, target_logits, top_logprobs=None, top_ids=None, top_rest=None,
                selector=None, prev=None, objective="ce", temperature=1.0, *, scales=None, gold=None,
                options=SelectorOptions()):
    logits = head_logits(hidden, weight, scales)
    sel = ()
    if selector is not None:  # first: under coupled the per-slot loss reads the logits it returns
        logits, sel = selector_ce(selector, hidden, logits, labels, prev, gold, options)
    logq = F.log_softmax(logits, dim=-1)
    ce = -logq.gather(-1, labels[:, None]).squeeze(-1)
    if objective in ACCEPTANCE:
        log_alpha = (log_acceptance(logits, target_logits, temperature, logq) if target_logits is not None else
                     log_acceptance_topk(logits, top_logprobs, top_ids, top_rest, temperature, logq))
        if objective == "tv":
            row = -torch.expm1(log_alpha)  # 1 - alpha
        elif objective == "nla":
            row = -log_alpha
        else:  # expected_tau: the rates themselves, made into the block loss by block_terms
            row = log_alpha.exp()
        return (row, ce, logits.argmax(-1), *sel)
    if target_logits is not None:
        logp = F.log_softmax(target_logits.float(), dim=-1)
        return ((logp.exp() * (logp - logq)).sum(-1), ce, logits.argmax(-1), *sel)
    if top_ids is None:
        return (ce, ce, logits.argmax(-1), *sel)
    logq_top = logq.gather(-1, top_ids)
    # the drafter's mass outside the k tokens, in log space; a large negative (not -inf) keeps the gradient
    # finite where the k tokens are the whole vocabulary (then rest = 0 and the term vanishes)
    log_q_rest = torch.logsumexp(logq.scatter(-1, top_ids, -1e4), dim=-1)
    lp = top_logprobs.float()
    rest = top_rest.float()
    kl = (lp.exp() * (lp - logq_top)).sum(-1) + rest * (torch.log(rest.clamp_min(1e-30)) - log_q_rest)
    return (kl, ce, logits.argmax(-1), *sel)


def row_losses(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk_logits: int = 0,
               target_logits: torch.Tensor | None = None, target_topk: tuple | None = None, selector=None,
               prev: torch.Tensor | None = None, *, objective: str | None = None, temperature: float = 1.0,
               scales=None, gold: torch.Tensor | None = None, options: SelectorOptions = SelectorOptions()):
    """Per-row losses of hidden [N, H]: (row_loss [N], ce [N], predictions [N]); row_loss is ce, or with
    target_logits [N, V] KL(softmax(target) || softmax(drafter)), or with target_topk (block_loss) the
    top-k KL; objective (block_terms') tv: 1 - alpha, nla: -log alpha, expected_tau: alpha itself (the
    block loss is made of the rates, `expected_rejections`), alpha at `temperature` (`log_acceptance`,
    `log_acceptance_topk`); with a selector (prev, gold [N], options: `selector_ce`) also its CE, choices [N],
    oracle [N] and the rows it counts [N].
    Chunked over rows as `weighted_ce`."""
    objective = _objective(objective, target_logits is not None or target_topk is not None, temperature)
    chunk_rows = max(1, chunk_logits // lm_head_weight.shape[0]) if chunk_logits > 0 else hidden.shape[0]
    top = tuple(target_topk) if target_topk is not None else (None, None, None)
    if hidden.shape[0] <= chunk_rows:
        return _chunk_rows(hidden, lm_head_weight, labels, target_logits, *top, selector, prev, objective,
                           temperature, scales=scales, gold=gold, options=options)
    n = len(labels.split(chunk_rows))
    split = lambda t: [None] * n if t is None else t.split(chunk_rows)  # noqa: E731
    parts = []
    for h, y, t, a, g, *tk in zip(hidden.split(chunk_rows), labels.split(chunk_rows), split(target_logits),
                                  split(prev), split(gold), *(split(t) for t in top)):
        parts.append(checkpoint(_chunk_rows, h, lm_head_weight, y, t, *tk, selector, a, objective, temperature,
                                scales=scales, gold=g, options=options, use_reentrant=False))
    return tuple(torch.cat(p) for p in zip(*parts))


def label_logits(logits: torch.Tensor, anchors: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, ...] the target's logits (or any per-position tensor [b, L, ...]: stored top-k distributions) that
    predict each labelled row's token: slot k of the block at anchor a is x_{a+k}, predicted at position
    a+k-1. logits: [b, L, ...]; anchors: [b, n]; rows: [N] flat indices into [b, n, B] (`label_rows`)."""
    b, L = logits.shape[:2]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1  # [b, n, B]
    flat = (torch.arange(b, device=anchors.device)[:, None, None] * L + pos.clamp(0, L - 1)).reshape(-1)
    return logits.reshape(b * L, *logits.shape[2:])[flat[rows]]


def label_rows(label_mask: torch.Tensor) -> torch.Tensor:
    """[N] flat indices of the labelled slots of label_mask [..., B] (the rows block_loss scores)."""
    return label_mask.reshape(-1).nonzero().flatten()
