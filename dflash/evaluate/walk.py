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
token ends it), so a block's walk tau is min(accepted + 1, left), its tree built `room - 1` deep.
"""

from __future__ import annotations

from dflash.drafter.ddtree import build_tree, accepted_length


def verify_depth(record: dict) -> int:
    """Slots live decoding verifies at this anchor: the block's drafted slots, at most room - 1."""
    return max(0, min(len(record["draft_tokens"]), record["room"] - 1))


def walk_tau(record: dict, budget: int | None = None) -> int:
    """Tokens live decoding commits at this block: the drafted path (budget None) or ddtree@budget."""
    path = record["target_tokens"]
    if budget is None:
        depth = verify_depth(record)
        accepted = 0
        while accepted < min(depth, len(path)) and record["draft_tokens"][accepted] == path[accepted]:
            accepted += 1
    else:
        tree = build_tree(record["topk_ids"], record["topk_logprobs"], budget, max_depth=verify_depth(record))
        accepted = accepted_length(tree, path)
    return min(accepted + 1, record["left"])


def walk(by_anchor: dict[int, dict], start: int, budget: int | None = None, missing=None) -> list[tuple[dict, int]]:
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
        if record["left"] < 1:
            return steps
        tau = walk_tau(record, budget)
        steps.append((record, tau))
        if tau >= record["left"]:  # the completion's last token is committed
            return steps
        pos += tau
