"""DDTree verification on every target kind: lossless against plain greedy decoding, and accepting exactly what
the teacher-forced DDTree predicts on the same drafts."""

import pytest
import torch

import dflash.drafter.decoding.engine as decode
from dflash.drafter.decoding.ddtree import Tree, ddtree_tau
from dflash.drafter.decoding.engine import greedy_generate, speculative_generate
from dflash.drafter.decoding.rules import Greedy
from dflash.drafter.decoding.sampling import Sampling
from dflash.drafter.decoding.states import new_cache, settle
from dflash.drafter.decoding.verify import tree_masks, tree_paths, verify_tree_paths
from dflash.target.features import target_forward
from tests.oracle import OracleDrafter

KINDS = ["tiny_qwen3_5", "tiny_qwen3_sliding"]


@pytest.fixture
def targets(tiny_targets):
    return {name: tiny_targets[name] for name in KINDS}


def prompt(seed, n=30):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_tree_paths_are_root_to_leaf():
    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 2], depths=[1, 1, 2, 2, 3])
    assert tree_paths(tree) == [[1], [0, 3], [0, 2, 4]]
    assert tree_paths(Tree([], [], [])) == [[]]


def assert_nodes_see_only_their_paths(target, ids, p: int, tree: Tree, label) -> None:
    """The tree verified in one sequence (tree_masks) after ids[:, :p]: each node's logits equal those of its own
    path decoded alone."""
    cache = new_cache(target, recording=False)
    target_forward(target, ids[:, :p], [], cache=cache)
    out = target_forward(target, torch.tensor([[int(ids[0, p])] + tree.tokens]), [],
                         attention_mask=tree_masks(target, tree, p),
                         position_ids=torch.tensor([[p] + [p + d for d in tree.depths]]), cache=cache,
                         logits_to_keep=0)
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j != -1:
            path.insert(0, tree.tokens[j])
            j = tree.parents[j]
        alone = target_forward(target, torch.cat([ids[:, : p + 1], torch.tensor([path])], 1), [], logits_to_keep=1)
        assert torch.allclose(out.logits[0, i + 1], alone.logits[0, -1], atol=1e-4), (label, i)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_mask_hides_siblings_under_every_attention_implementation(attn):
    """Eager attention adds a boolean mask to its scores as 0/1, so the tree mask must be additive."""
    from tests.drafter.decoding.test_engine import tiny_qwen3

    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 2], depths=[1, 1, 2, 2, 3])
    assert_nodes_see_only_their_paths(tiny_qwen3(attn_implementation=attn), prompt(5, 9), 8, tree, attn)


def test_sliding_layers_get_their_window_in_the_tree_mask(targets):
    """Per-layer-type masks on the sliding-window target, whose window (8) the 30-token context runs past."""
    target = targets["tiny_qwen3_sliding"]
    assert target.tree_verification() == "sequence"
    p = 29
    tree = Tree(tokens=[5, 6, 7, 8, 9, 10], parents=[-1, -1, 0, 0, 2, 4], depths=[1, 1, 2, 2, 3, 4])
    masks = tree_masks(target, tree, p)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert not torch.equal(masks["full_attention"], masks["sliding_attention"])
    assert_nodes_see_only_their_paths(target, prompt(5), p, tree, "sliding")


def test_paths_batch_gives_each_node_its_own_paths_logits(targets):
    """On the hybrid target, a tree verified as a batch of paths: the committed cache is then the accepted
    row's, and the next forward sees exactly the committed text."""
    target = targets["tiny_qwen3_5"]
    assert target.tree_verification() == "paths"
    ids, p = prompt(6), 29
    cache = new_cache(target, recording=True)
    target_forward(target, ids[:, :p], [], cache=cache)
    settle(cache)
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    seen = {}

    class Scripted(Greedy):  # accept 5 then 7, reject below 7 (the target must then say something not 8)
        def tokens(self, logits, first):
            seen[first] = logits
            return [{p + 1: 5, p + 2: 7}.get(first, 3)]

    verdict = verify_tree_paths(target, [1, 3], cache, int(ids[0, p]), tree, p, Scripted(Sampling()))
    assert verdict.accepted == [5, 7] and verdict.bonus == 3 and verdict.tokens == 2 * 4
    for first, path in ((p + 1, []), (p + 2, [5]), (p + 3, [5, 7])):
        alone = target_forward(target, torch.cat([ids[:, : p + 1], torch.tensor([path], dtype=torch.long)], 1), [],
                               logits_to_keep=1)
        assert torch.allclose(seen[first], alone.logits[0, -1:], atol=1e-4), path
    nxt = target_forward(target, torch.tensor([[3]]), [], cache=cache, logits_to_keep=1)
    fresh = target_forward(target, torch.cat([ids[:, : p + 1], torch.tensor([[5, 7, 3]])], 1), [], logits_to_keep=1)
    assert torch.allclose(nxt.logits, fresh.logits, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [4, 8, 16, 32])
def test_tree_decoding_is_lossless_and_accepts_what_teacher_forcing_predicts(targets, kind, budget, monkeypatch):
    target = targets[kind]
    trees = []
    real = decode.draft_tree

    def recorded(logits, tree_budget, room):
        trees.append((logits, room))
        return real(logits, tree_budget, room)

    monkeypatch.setattr(decode, "draft_tree", recorded)
    for seed, scale in ((0, 5000.0), (1, 300.0)):  # sharp: deep trees, rejections mid-path; softer: wider trees
        ids = prompt(seed, 12 + 9 * seed)
        plain = greedy_generate(target, ids, 40)
        truth = plain[0].tolist()
        oracle = OracleDrafter(target, truth, wrong=lambda p, k: (p * 7 + k) % 5 == 0 or (p + k) % 11 == 0,
                               scale=scale)
        trees.clear()
        res = speculative_generate(oracle, target, ids, 40, tree_budget=budget)
        assert torch.equal(res.output_ids, plain), (kind, budget, seed)
        assert res.target_forwards == 1 + len(res.acceptance_lengths)  # no replay
        p = ids.shape[1]
        for tau, (logits, room) in zip(res.acceptance_lengths, trees):
            depth = max(0, min(logits.shape[0], room - 1))
            logp = torch.log_softmax(logits[:depth], -1).topk(min(budget, logits.shape[-1]), dim=-1)
            assert tau == ddtree_tau(logp.indices.tolist(), logp.values.tolist(), truth[p + 1: p + 1 + depth], budget)
            p += tau
        assert p == len(truth) - 1
