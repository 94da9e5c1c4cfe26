import random

import pytest

from dflash.drafter.ddtree import accepted_length, build_tree, ddtree_tau


def random_block(rng, slots=7, k=8, vocab=20):
    ids, lps = [], []
    for _ in range(slots):
        toks = rng.sample(range(vocab), k)
        raw = sorted((rng.random() for _ in range(k)), reverse=True)
        total = sum(raw) + rng.random()
        ids.append(toks)
        lps.append([__import__("math").log(r / total) for r in raw])
    return ids, lps


def test_tree_holds_the_greedy_path_plus_budget_nodes_as_a_tree():
    rng = random.Random(0)
    ids, lps = random_block(rng)
    tree = build_tree(ids, lps, budget=10)
    assert tree.tokens[:7] == [slot[0] for slot in ids] and len(tree.tokens) == 17
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
        assert p < i and (p == -1) == (d == 1) and (p == -1 or tree.depths[p] == d - 1)
        assert tree.tokens[i] in ids[d - 1][:10]


def test_best_first_takes_the_most_probable_prefixes():
    ids = [[1, 2], [3, 4]]
    lps = [[-0.1, -0.5], [-2.0, -2.1]]
    tree = build_tree(ids, lps, budget=1)
    assert tree.tokens == [1, 3, 2]  # (2,) at -0.5 beats (1, 4) at -2.2


@pytest.mark.parametrize("seed", range(20))
def test_never_below_the_single_path_and_monotone_in_budget(seed):
    rng = random.Random(seed)
    ids, lps = random_block(rng)
    path = [rng.choice(slot[:3]) for slot in ids]
    single = accepted_length(build_tree(ids, lps, 0), path) + 1
    taus = [ddtree_tau(ids, lps, path, n) for n in (0, 1, 2, 4, 8, 16, 32)]
    assert taus[0] == single and all(t >= single for t in taus)
    assert taus == sorted(taus)


def test_full_path_in_tree_is_accepted_whole():
    ids, lps = [[5, 6]] * 3, [[-0.1, -2.0]] * 3
    assert ddtree_tau(ids, lps, [5, 5, 5], 0) == 4
    assert ddtree_tau(ids, lps, [5, 6, 5], 0) == 2 and ddtree_tau(ids, lps, [5, 6, 5], 3) >= 3
