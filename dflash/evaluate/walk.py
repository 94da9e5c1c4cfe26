"""The decoding walk: which teacher-forced blocks live decoding would draft, and what each commits.

Live decoding drafts a block only where the previous one stopped: the first block at the first
response position (the prefill made that token), each next one at the previous anchor + its tau.
Walking the teacher-forced records the same way gives, on the same completions, the blocks and
acceptance lengths of live decoding (DESIGN §5), with no target in the loop. The mean over every
anchor is a different estimator: it counts the easy middle of long accepted runs again and again.

A record (dflash.evaluate.teacher_forced) carries what the walk needs besides the drafts:
`left`, the completion tokens after the anchor, and `room`, the tokens live decoding may still
commit there (eval.max_new_tokens minus those already generated). Live verification drafts at most
`room - 1` tokens (the bonus fills the room) and keeps nothing past the completion's end (a stop
token ends it), so a block's walk tau is min(accepted + 1, left), its tree built `room - 1` deep. The walk
ends where live decoding does: at the completion's end or at the budget, whichever comes first (`span`): a
cached completion longer than eval.max_new_tokens is walked only as far as live decoding generates.

A walk follows one verifier (`variant`): None, the drafted chain (DFlash 2: the selector's path); an int N,
the DDTree of N nodes from the per-slot marginals; and for DFlash 2 records "unary" (the argmax chain),
"oracle" (gold inside the unary top-K at every slot: the selector's ceiling), "beam" (the chain a beam over the
selector's pairwise scores finds, eval.decode.selector_beam) and "pair@N" (the DDTree of N nodes from the selector's
pairwise scores, whose accepted length the record carries).
"""

from __future__ import annotations

from dflash.drafter.decoding.ddtree import build_tree, accepted_length


def verify_depth(record: dict) -> int:
    """Slots live decoding verifies at this anchor: the block's drafted slots, at most room - 1."""
    return max(0, min(len(record["draft_tokens"]), record["room"] - 1))


def span(record: dict) -> int:
    """Tokens live decoding still commits from this anchor: what is left of the completion, within the budget."""
    return min(record["left"], record["room"])


CHAINS = {None: "draft_tokens", "unary": "unary_tokens", "oracle": "oracle_tokens", "beam": "beam_tokens"}


def walk_variants(budgets: list[int], dflash2: bool, beam: bool = False) -> list:
    """The verifiers a record set is walked with: the chain and each DDTree budget; DFlash 2 adds the unary and
    oracle chains, the pairwise DDTree per budget and, with eval.decode.selector_beam > 1, the beam's chain."""
    extra = ["unary", "oracle", *(["beam"] if beam else []), *[f"pair@{b}" for b in budgets]] if dflash2 else []
    return [None, *budgets, *extra]


def variant_key(variant, suffix: str = "") -> str:
    """The metric name of a walk: tau, ddtree@N, tau_unary, tau_oracle, tau_beam, ddtree_pair@N (+ suffix)."""
    if variant is None or variant in ("unary", "oracle", "beam"):
        return "tau" + ("" if variant is None else f"_{variant}") + suffix
    if isinstance(variant, str):
        return f"ddtree_{variant}{suffix}"
    return f"ddtree@{variant}{suffix}"


def walk_tau(record: dict, budget=None) -> int:
    """Tokens live decoding commits at this block with verifier `budget` (a walk variant, see above: None the
    drafted path, N ddtree@N)."""
    path = record["target_tokens"]
    if isinstance(budget, str) and budget.startswith("pair@"):
        accepted = record["pair_accepted"][budget.removeprefix("pair@")]
    elif budget is None or isinstance(budget, str):
        tokens = record[CHAINS[budget]]
        depth = verify_depth(record)
        accepted = 0
        while accepted < min(depth, len(path)) and tokens[accepted] == path[accepted]:
            accepted += 1
    else:
        tree = build_tree(record["topk_ids"], record["topk_logprobs"], budget, max_depth=verify_depth(record))
        accepted = accepted_length(tree, path)
    return min(accepted + 1, span(record))


def walk(by_anchor: dict[int, dict], start: int, budget=None, missing=None) -> list[tuple[dict, int]]:
    """(record, tau) of each block on the decoding walk from `start`, the last partial block included.

    by_anchor: a prompt's records by anchor. missing(anchor): called for an anchor the walk reaches
    that has no record yet; it must add one to by_anchor (teacher-forced evaluation drafts it then).
    """
    steps, pos = [], start
    while True:
        if pos not in by_anchor:
            if missing is None:
                raise KeyError(f"the decoding walk reaches anchor {pos}, which has no record")
            missing(pos)
        record = by_anchor[pos]
        if span(record) < 1:
            return steps
        tau = walk_tau(record, budget)
        steps.append((record, tau))
        if tau >= span(record):  # the completion's last token, or the budget's, is committed
            return steps
        pos += tau


def accepted_weights(rates: list[float], depth: int) -> list[float]:
    """[P(exactly j drafts accepted)], j = 0..depth: prod_{i<=j} r_i * (1 - r_{j+1}), and prod_{i<=depth} r_i for all
    of them, from per-slot rates r (slot i accepted with rate r_i once slots 1..i-1 were)."""
    out, reach = [], 1.0
    for r in rates[:depth]:
        out.append(reach * (1.0 - r))
        reach *= r
    return out + [reach]


def pathwise_weights(record: dict, depth: int) -> list[float]:
    """The unbiased expected walk's weights (`expected_blocks`) from the record's `accept`: per drafted slot k,
    r_k = min(1, q_k(x_k) / p_k(x_k)) at the completion's token x_k (dflash.evaluate.teacher_forced.slot_rates)."""
    return accepted_weights(record["accept"], depth)


def alpha_weights(record: dict, depth: int) -> list[float]:
    """An approximation's weights (`tau_alpha_product`) from the record's `alpha` (alpha_k = sum_x min(p_k, q_k)):
    slots taken as independent, and the token after a rejection as the completion's, unweighted."""
    return accepted_weights(record["alpha"], depth)


def expected_blocks(by_anchor: dict[int, dict], start: int, weights=pathwise_weights) -> float:
    """The expected number of blocks live decoding with rejection sampling drafts to commit the completion from
    `start`: unbiased, over completions sampled from the target, for live decoding at the same settings.

    Why (weights = `pathwise_weights`). A block at anchor a drafts d = verify_depth slots; live, slot i's draft is
    accepted with probability min(1, p_i/q_i) at the draft, and the first rejected slot emits a token of the
    residual (p_i - q_i)+ / (1 - alpha_i). The probability that live decoding accepts exactly j drafts and
    commits the tokens y_1..y_{j+1} is prod_{i<=j} min(p_i, q_i)(y_i) * (p_{j+1} - q_{j+1})+(y_{j+1}); all d
    accepted and the bonus y_{d+1}: prod_{i<=d} min(p_i, q_i)(y_i) * p_{d+1}(y_{d+1}). With
    r_i(y) = min(1, q_i(y) / p_i(y)), min(p, q) = p r and (p - q)+ = p (1 - r), so that probability is
    p(y_1..y_{j+1}) * prod_{i<=j} r_i(y_i) * (1 - r_{j+1}(y_{j+1})): the target's probability of the committed
    tokens times a weight. Chaining blocks, live decoding writes a text y with blocks b with probability
    p(y) * prod over b of its weight; a completion x of the held-out set is a sample of p (same settings), so
    summing the blocks of every walk along x, each weighted by its product of weights, is an unbiased estimate
    of live decoding's expected blocks. The token after a rejection is x's own there: weighted by 1 - r it is a
    sample of the residual, the token the drafter under-predicted, which is where the next block starts.
    (Weighting "exactly j" by P(slots 1..j) - P(slots 1..j+1) averages the rejected slot's token out and
    continues from an unweighted sample of p: biased, since the next block's acceptance depends on that token.)
    The weights are non-negative and sum to 1 at every block (no clipping); with r in {0, 1} (temperature -> 0)
    this is the greedy walk.

    So E[a] = 1 + sum_j w_a(j) E[a + min(j + 1, span)], w_a = weights(record at a, d), E = 0 once the completion is
    committed (its end or the budget: `span`), solved from the end back; the walk's expected tau is the tokens
    committed (the start record's `span`) over E[start]. weights = `alpha_weights` gives the independent-slot
    approximation (`tau_alpha_product`), not an unbiased estimate.
    """
    end = start + span(by_anchor[start])  # the last position decoding commits (completion's end or budget)
    expected = {end: 0.0}
    for a in range(end - 1, start - 1, -1):
        if a not in by_anchor:
            raise KeyError(f"the expected walk needs a record at every anchor; {a} has none")
        record = by_anchor[a]
        rest = span(record)
        total = 1.0
        for j, w in enumerate(weights(record, verify_depth(record))):
            n = min(j + 1, rest)
            if n < rest:
                total += w * expected[a + n]
        expected[a] = total
    return expected[start]
