"""DDTree (arXiv 2604.12989): a draft tree built from a block drafter's per-slot distributions.

Nodes are token prefixes; a prefix's score is the product of the drafter's per-slot
probabilities of its tokens (slots are drafted in parallel, so the score factorises). The tree
of budget N holds the N most probable prefixes, found best-first with a heap whose entries are
(score, ranks): popping a prefix adds it to the tree and pushes its first child and its next
sibling. Nothing is forced in: no greedy chain, so for small N a wide, shallow tree can accept
less than the single drafted path; the best-first sets are nested, so acceptance never falls as N
grows. This is `ddtree@N` as the DDTree paper and its public code report it (DESIGN §5).

A token of rank r in its slot has r better siblings that are popped first, so only the top-N
tokens of a slot can enter a tree of N nodes: one top-K per slot (K = the largest budget)
serves every budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class Tree:
    tokens: list[int]
    """Token of each node, in the order the nodes were taken (best first)."""
    parents: list[int]
    """Parent node index, -1 for children of the root (the last committed token)."""
    depths: list[int]
    """1-based slot of each node."""


def build_tree(topk_ids: list[list[int]], topk_logprobs: list[list[float]], budget: int,
               max_depth: int | None = None) -> Tree:
    """The `budget` most probable prefixes of at most `max_depth` slots, as a tree.

    topk_ids/topk_logprobs: per slot (1..B-1), tokens sorted by descending probability.
    """
    depth_limit = len(topk_ids) if max_depth is None else min(max_depth, len(topk_ids))
    width = min(len(topk_ids[0]), budget) if topk_ids else 0
    tree = Tree([], [], [])
    node_of: dict[tuple[int, ...], int] = {}
    heap = [(-topk_logprobs[0][0], (0,))] if depth_limit > 0 and width > 0 else []
    while heap and len(tree.tokens) < budget:
        neg, ranks = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        node_of[ranks] = len(tree.tokens)
        tree.tokens.append(topk_ids[d - 1][r])
        tree.parents.append(node_of[ranks[:-1]] if d > 1 else -1)
        tree.depths.append(d)
        if d < depth_limit:
            heapq.heappush(heap, (neg - topk_logprobs[d][0], ranks + (0,)))
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


def build_tree_pairwise(cand_ids: list[list[int]], first_logp: list[float], table_logp: list[list[list[float]]],
                        budget: int, max_depth: int | None = None) -> Tree:
    """DDTree from DFlash 2's selector: a child's probability is conditioned on its parent's token.

    cand_ids [S][K]: the selector's candidates per slot; first_logp [K]: log q(candidate | anchor) at slot 1;
    table_logp [S-1][K][K]: table_logp[s][i][j] = log q(candidate j of slot s+2 | candidate i of slot s+1),
    each row normalised over the K candidates (dflash.drafter.dflash2 `CandidateSelector.transitions`, softmax
    per row). A prefix scores the sum of its conditional log-probabilities; best-first as `build_tree`, a popped
    node pushing its next sibling (the parent's next-best candidate) and its first child (its own best
    successor), so the sets stay nested in the budget. No public code builds this tree (DFlash 2 serves the
    selector's single path); `build_tree` on the unary marginals is the DDTree beside it.
    """
    depth_limit = len(cand_ids) if max_depth is None else min(max_depth, len(cand_ids))
    if depth_limit <= 0 or budget <= 0:
        return Tree([], [], [])
    orders: dict[tuple[int, int], list[int]] = {}

    def row(depth: int, parent_idx: int) -> list[float]:
        return first_logp if depth == 1 else table_logp[depth - 2][parent_idx]

    def order(depth: int, parent_idx: int) -> list[int]:  # candidate indices of slot `depth`, best first
        key = (depth, parent_idx if depth > 1 else -1)
        if key not in orders:
            r = row(depth, parent_idx)
            orders[key] = sorted(range(len(r)), key=lambda j: -r[j])
        return orders[key]

    tree, tie = Tree([], [], []), 0
    # heap entries: (-score, tie, depth, parent node, parent's candidate index, rank among its siblings)
    heap = [(-first_logp[order(1, -1)[0]], tie, 1, -1, -1, 0)]
    while heap and len(tree.tokens) < budget:
        neg, _, d, parent, parent_idx, rank = heapq.heappop(heap)
        sibs = order(d, parent_idx)
        j = sibs[rank]
        node = len(tree.tokens)
        tree.tokens.append(cand_ids[d - 1][j])
        tree.parents.append(parent)
        tree.depths.append(d)
        if d < depth_limit:
            child = order(d + 1, j)[0]
            tie += 1
            heapq.heappush(heap, (neg - row(d + 1, j)[child], tie, d + 1, node, j, 0))
        if rank + 1 < len(sibs):
            r = row(d, parent_idx)
            tie += 1
            heapq.heappush(heap, (neg + r[j] - r[sibs[rank + 1]], tie, d, parent, parent_idx, rank + 1))
    return tree
