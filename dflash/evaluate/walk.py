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
"oracle" (gold inside the unary top-K at every slot: the selector's ceiling) and "pair@N" (the DDTree of
N nodes from the selector's pairwise scores, whose accepted length the record carries).
"""

from __future__ import annotations

from dflash.drafter.ddtree import build_tree, accepted_length


def verify_depth(record: dict) -> int:
    """Slots live decoding verifies at this anchor: the block's drafted slots, at most room - 1."""
    return max(0, min(len(record["draft_tokens"]), record["room"] - 1))


def span(record: dict) -> int:
    """Tokens live decoding still commits from this anchor: what is left of the completion, within the budget."""
    return min(record["left"], record["room"])


CHAINS = {None: "draft_tokens", "unary": "unary_tokens", "oracle": "oracle_tokens"}


def walk_variants(budgets: list[int], dflash2: bool) -> list:
    """The verifiers a record set is walked with: the chain and each DDTree budget; DFlash 2 adds the unary and
    oracle chains and the pairwise DDTree per budget."""
    extra = ["unary", "oracle", *[f"pair@{b}" for b in budgets]] if dflash2 else []
    return [None, *budgets, *extra]


def variant_key(variant, suffix: str = "") -> str:
    """The metric name of a walk: tau, ddtree@N, tau_unary, tau_oracle, ddtree_pair@N (+ suffix)."""
    if variant is None or variant in ("unary", "oracle"):
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


def product_reach(record: dict) -> list[float]:
    """P(the first k drafts are all accepted) as prod_{j<=k} alpha_j, k = 1..S: slots taken as independent."""
    out, reach = [], 1.0
    for a in record["alpha"]:
        reach *= a
        out.append(reach)
    return out


def weighted_reach(record: dict) -> list[float]:
    """P(the first k drafts are all accepted), k = 1..S, estimated without bias from a completion sampled from
    the target: the record's `reach` (dflash.evaluate.teacher_forced.slot_alpha)."""
    return record["reach"]


def expected_blocks(by_anchor: dict[int, dict], start: int, reach=weighted_reach) -> float:
    """The expected number of blocks live decoding with rejection sampling drafts to commit the completion from
    `start`, given each record's reach(record)[k-1] = P(its first k drafts are all accepted).

    A block at anchor a with d = verify_depth drafts accepts exactly j of them with probability
    reach_j - reach_{j+1} (reach_0 = 1; all d: reach_d) and commits min(j + 1, span) tokens; the next block is
    at a + that. So E[a] = 1 + sum_j P_a(j) E[a + min(j + 1, span)], E = 0 once the completion is committed,
    solved from the end back. The walk's expected tau is the tokens committed (the start record's `span`)
    over E[start]; with reach in {0, 1} (temperature -> 0) it is the greedy walk's.
    """
    end = start + span(by_anchor[start])  # the last position decoding commits (completion's end or budget)
    expected = {end: 0.0}
    for a in range(end - 1, start - 1, -1):
        if a not in by_anchor:
            raise KeyError(f"the expected walk needs a record at every anchor; {a} has none")
        record = by_anchor[a]
        depth, rest = verify_depth(record), span(record)
        r = [1.0] + reach(record)[:depth]
        total = 1.0
        for j in range(depth + 1):
            n = min(j + 1, rest)
            if n < rest:
                total += (r[j] - (r[j + 1] if j < depth else 0.0)) * expected[a + n]
        expected[a] = total
    return expected[start]
