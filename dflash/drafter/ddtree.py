"""DDTree (arXiv 2604.12989): a draft tree built from a block drafter's per-slot distributions.

Nodes are token prefixes; a prefix's score is the product of the drafter's per-slot
probabilities of its tokens (slots are drafted in parallel, so the score factorises). Our
`ddtree@N` tree is the drafted block itself (the greedy path single-path DFlash verifies)
plus the N most probable further prefixes, found best-first with a heap whose entries are
(score, ranks): popping a prefix pushes its first child and its next sibling. Keeping the
greedy path means ddtree@N never accepts less than the single path, and the best-first sets
are nested, so acceptance never falls as N grows. Only the top-N tokens of a slot can enter a
tree of N extra nodes (a token of rank r has r better siblings that are popped first), so one
top-K per slot (K = the largest budget) serves every budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class Tree:
    tokens: list[int]
    """Token of each node (node 0 is the first drafted slot's greedy token, ...)."""
    parents: list[int]
    """Parent node index, -1 for children of the root (the last committed token)."""
    depths: list[int]
    """1-based slot of each node."""


def build_tree(topk_ids: list[list[int]], topk_logprobs: list[list[float]], budget: int,
               max_depth: int | None = None) -> Tree:
    """Greedy path over `max_depth` slots + `budget` best-first extra nodes.

    topk_ids/topk_logprobs: per slot (1..B-1), tokens sorted by descending probability.
    """
    depth_limit = len(topk_ids) if max_depth is None else min(max_depth, len(topk_ids))
    index: dict[tuple[int, ...], int] = {}
    tree = Tree([], [], [])

    def add(ranks: tuple[int, ...]) -> None:
        prefix = tuple(topk_ids[d][r] for d, r in enumerate(ranks))
        if prefix in index:
            return
        index[prefix] = len(tree.tokens)
        tree.tokens.append(prefix[-1])
        tree.parents.append(index[prefix[:-1]] if len(prefix) > 1 else -1)
        tree.depths.append(len(prefix))

    for d in range(depth_limit):
        add((0,) * (d + 1))
    greedy = len(tree.tokens)
    width = len(topk_ids[0]) if topk_ids else 0
    heap = [(-topk_logprobs[0][0], (0,))] if depth_limit and width else []
    while heap and len(tree.tokens) < greedy + budget:
        neg, ranks = heapq.heappop(heap)
        add(ranks)
        d = len(ranks)
        if d < depth_limit:
            heapq.heappush(heap, (neg - topk_logprobs[d][0], ranks + (0,)))
        r = ranks[-1]
        if r + 1 < width:
            heapq.heappush(heap, (neg + topk_logprobs[d - 1][r] - topk_logprobs[d - 1][r + 1],
                                  ranks[:-1] + (r + 1,)))
    return tree


def accepted_length(tree: Tree, path: list[int]) -> int:
    """How many tokens of `path` (the target's choices for slots 1..) the tree accepts."""
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    node, n = -1, 0
    for token in path:
        node = children.get((node, token), None)
        if node is None:
            break
        n += 1
    return n


def ddtree_tau(topk_ids, topk_logprobs, path: list[int], budget: int) -> int:
    """Acceptance length (accepted + 1 bonus) of ddtree@budget against the target path."""
    return accepted_length(build_tree(topk_ids, topk_logprobs, budget, max_depth=len(path)), path) + 1
