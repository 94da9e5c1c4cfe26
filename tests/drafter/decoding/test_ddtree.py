"""ddtree@N as DESIGN §5 defines it, checked against an independent implementation."""

import math
import random

import pytest

from dflash.drafter.decoding.ddtree import accepted_length, build_tree, ddtree_tau


def random_block(rng, slots=7, k=32, vocab=64, peaked=False):
    """Per slot: k distinct tokens with descending log-probs (peaked: the top token holds ~90%)."""
    ids, lps = [], []
    for _ in range(slots):
        raw = sorted((rng.random() for _ in range(k)), reverse=True)
        if peaked:
            raw[0] = 9 * sum(raw[1:])
        total = sum(raw) + rng.random()
        ids.append(rng.sample(range(vocab), k))
        lps.append([math.log(r / total) for r in raw])
    return ids, lps


def reference_tree(ids, lps, n, depth):
    """The n most probable prefixes (tokens of the top-n of each slot, at most `depth` slots), grown
    from an explicit frontier: repeatedly take the best prefix among the children of those taken."""
    width = min(n, len(ids[0]))
    frontier = {(r,): lps[0][r] for r in range(width)} if depth else {}
    taken = []
    while frontier and len(taken) < n:
        best = max(frontier, key=lambda ranks: (frontier[ranks], [-r for r in ranks]))
        score = frontier.pop(best)
        taken.append(best)
        if len(best) < depth:
            frontier.update({best + (r,): score + lps[len(best)][r] for r in range(width)})
    return {tuple(ids[d][r] for d, r in enumerate(ranks)) for ranks in taken}


def prefixes(tree):
    out = []
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j != -1:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(path)))
    return out


def reference_tau(ids, lps, path, n):
    tree = reference_tree(ids, lps, n, len(path))
    accepted = 0
    while accepted < len(path) and tuple(path[: accepted + 1]) in tree:
        accepted += 1
    return accepted + 1


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_tree_is_the_n_most_probable_prefixes(seed, peaked):
    rng = random.Random(seed)
    ids, lps = random_block(rng, peaked=peaked)
    for n in (1, 2, 4, 8, 16, 32):
        tree = build_tree(ids, lps, n)
        assert len(tree.tokens) == n  # N nodes in all: nothing forced in, nothing beyond
        assert set(prefixes(tree)) == reference_tree(ids, lps, n, len(ids))
        for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
            assert p < i and (p == -1) == (d == 1) and (p == -1 or tree.depths[p] == d - 1)
            assert tree.tokens[i] in ids[d - 1][:n]


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_acceptance_matches_the_reference_and_never_falls_with_n(seed, peaked):
    rng = random.Random(seed)
    ids, lps = random_block(rng, peaked=peaked)
    path = [slot[min(int(rng.expovariate(1.0)), 5)] for slot in ids]  # mostly the top tokens
    taus = [ddtree_tau(ids, lps, path, n) for n in (1, 2, 4, 8, 16, 32)]
    assert taus == [reference_tau(ids, lps, path, n) for n in (1, 2, 4, 8, 16, 32)]
    assert taus == sorted(taus)


def test_a_wide_shallow_tree_can_accept_less_than_the_single_path():
    # slot 1 is torn between two tokens: with N=2 the tree takes both (wide and shallow) and no
    # second slot, where the single drafted path reaches slot 3; with N=4 the tree reaches it too
    ids = [[1, 2], [3, 4], [5, 6]]
    lps = [[math.log(0.5), math.log(0.45)], [math.log(0.6), math.log(0.4)], [math.log(0.99), math.log(0.01)]]
    path = [1, 3, 5]
    single_path = accepted_length(build_tree([[s[0]] for s in ids], [[s[0]] for s in lps], 3), path) + 1
    assert single_path == 4 and ddtree_tau(ids, lps, path, 2) == 2
    assert ddtree_tau(ids, lps, path, 4) == 4


def test_best_first_takes_the_most_probable_prefix_next():
    ids = [[1, 2], [3, 4]]
    lps = [[-0.1, -0.5], [-2.0, -2.1]]
    assert build_tree(ids, lps, budget=2).tokens == [1, 2]  # (2,) at -0.5 beats (1, 3) at -2.1
    assert build_tree(ids, lps, budget=3).tokens == [1, 2, 3]


def test_depth_is_bounded_by_the_path():
    ids, lps = [[5, 6]] * 3, [[-0.01, -5.0]] * 3
    assert max(build_tree(ids, lps, 8, max_depth=2).depths) == 2
    assert ddtree_tau(ids, lps, [5, 5, 5], 3) == 4 and ddtree_tau(ids, lps, [5, 6, 5], 2) == 2
