"""One target forward verifies a drafted block or a DDTree; the cache then holds exactly what was accepted.

- chain: [x_p, d_1..d_m] as one sequence (1 + m tokens).
- tree as one sequence (`Target.tree_verification() == "sequence"`: attention-only targets whose attention
  takes a 4D mask, sdpa or eager): the root x_p and the N nodes, each seeing the cache, the root and its
  own ancestors (1 + N tokens). With sliding-window layers the mask is given per layer type, and the
  sliding layers' mask also keeps their window, counted in positions along the node's own path.
- tree as a batch of paths ("paths": hybrid targets, whose recurrent states cannot branch inside one
  sequence, or attention that takes no custom mask): each root-to-leaf path is one row continuing the
  committed context, the cache copied per row for that forward (P paths of at most D drafts: P x (1 + D)
  tokens, and P copies of the attention KV of the context); the row of the longest accepted path is kept.
Linear-attention states are recorded per verified position during the forward (dflash.drafter.decoding.states), so
no verification is followed by a replay: one target forward per block, chain or tree. Which drafts are accepted
and which token the target adds is the run's rule (dflash.drafter.decoding.rules: greedy, rejection sampling, seeded
or exact match), the same for the chain and for every tree node.

A clock (dflash.drafter.decoding.engine.Clock) given to a verification charges its target forward to `verify` and what
comes before it (the block's tensors, masks, rows) to `other`; the caller's next lap charges the acceptance and
the cache's trimming to `other` too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dflash.drafter.decoding.ddtree import Tree
from dflash.drafter.decoding.rules import Rule
from dflash.drafter.decoding.states import StateRecorder, commit, keep_attention, select_rows
from dflash.target.features import target_forward


@dataclass
class Verdict:
    accepted: list[int]
    """The drafted tokens the target accepted, in order."""
    bonus: int
    """The target's own token after them."""
    features: torch.Tensor
    """[1, 1 + len(accepted), F]: the target features of x_p and the accepted tokens."""
    tokens: int
    """Tokens the target forward processed (its cost)."""


def verify_chain(target, layer_ids, cache, anchor: int, drafts: list[int], p: int, rule: Rule,
                 q: torch.Tensor | None = None, clock=None) -> Verdict:
    """Verify [x_p, d_1..d_m] (the cache holds positions < p) by `rule` (dflash.drafter.decoding.rules); q [m, V]: the
    distributions the drafts were drawn from (None: chosen, as greedy drafts are)."""
    block = torch.tensor([[anchor] + drafts], device=target.device)
    n = block.shape[1]
    recorder = StateRecorder(target, [(0, t) for t in range(n)]) if target.is_hybrid and n > 1 else None
    _lap(clock, "other")
    with recorder.recording() if recorder else nullcontext():
        out = target_forward(target, block, layer_ids, cache=cache, logits_to_keep=0)
    _lap(clock, "verify")
    a, bonus = rule.chain(out.logits[0], p + 1, drafts, q)
    commit(cache, p, a + 1, n, recorder.state(a) if recorder else None)
    return Verdict(drafts[:a], bonus, out.features[:, : a + 1], n)


def _lap(clock, part: str) -> None:
    if clock is not None:
        clock.lap(part)


def _children(tree: Tree) -> dict[int, list[int]]:
    """{node: its children's node indices in node order (best first)}; -1 is the root."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(i)
    return children


def _walk(tree: Tree, logits_of: Callable[[int], torch.Tensor], p: int, rule: Rule) -> tuple[list[int], list[int], int]:
    """Follow the rule's choices down the tree: (accepted tokens, their nodes, bonus). logits_of(node) is the
    target's next-token logits [1, V] after `node` (-1: the root)."""
    children = _children(tree)
    node, nodes, accepted = -1, [], []
    while True:
        kids = children.get(node, [])
        i, token = rule.node(logits_of(node)[0], p + 1 + len(accepted), [tree.tokens[k] for k in kids])
        if i < 0:
            return accepted, nodes, token
        accepted.append(token)
        nodes.append(kids[i])
        node = kids[i]


def _seen(parents: list[int], past: int, device) -> torch.Tensor:
    """[n+1, past+n+1] bool: what each of the root and the n nodes may attend to (the cache, the root, its
    own ancestors and itself)."""
    n = len(parents)
    seen = torch.zeros(n + 1, past + n + 1, dtype=torch.bool, device=device)
    seen[:, : past + 1] = True
    for i in range(n):
        j = i
        while j != -1:
            seen[i + 1, past + 1 + j] = True
            j = parents[j]
    return seen


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where seen, dtype min elsewhere, [1, 1, q, k]: eager attention adds a boolean mask as 0/1."""
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    return mask.masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def tree_masks(target, tree: Tree, past: int) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree mask, or with sliding-window layers one per layer type (transformers takes a mapping): a
    sliding layer's node at position q also sees only keys at positions k with q - k < window, as plain
    decoding of its path would."""
    seen = _seen(tree.parents, past, target.device)
    full = _additive(seen, target.dtype)
    types = set(target.layer_types)
    if "sliding_attention" not in types:
        return full
    window = target.config.sliding_window
    q = torch.tensor([past] + [past + d for d in tree.depths], device=target.device)
    k = torch.cat([torch.arange(past, device=target.device), q])
    masks = {t: full for t in types}
    masks["sliding_attention"] = _additive(seen & (q[:, None] - k[None, :] < window), target.dtype)
    return masks


def verify_tree_sequence(target, layer_ids, cache, anchor: int, tree: Tree, p: int, rule: Rule,
                         clock=None) -> Verdict:
    """The tree as one sequence under an ancestor-only mask; the accepted path's KV kept."""
    tokens = torch.tensor([[anchor] + tree.tokens], device=target.device)
    positions = torch.tensor([[p] + [p + d for d in tree.depths]], device=target.device)
    masks = tree_masks(target, tree, p)
    _lap(clock, "other")
    out = target_forward(target, tokens, layer_ids, attention_mask=masks, position_ids=positions, cache=cache,
                         logits_to_keep=0)
    _lap(clock, "verify")
    accepted, nodes, bonus = _walk(tree, lambda node: out.logits[0, node + 1: node + 2], p, rule)
    path = [0] + [i + 1 for i in nodes]
    keep_attention(cache, torch.cat([torch.arange(p, device=target.device),
                                     p + torch.tensor(path, device=target.device)]))
    return Verdict(accepted, bonus, out.features[:, path], tokens.shape[1])


def tree_paths(tree: Tree) -> list[list[int]]:
    """The root-to-leaf paths of the tree (node indices, root excluded), one per leaf, in node order; one
    empty path for an empty tree."""
    parents = set(tree.parents)
    paths = []
    for leaf in (i for i in range(len(tree.tokens)) if i not in parents):
        path, j = [], leaf
        while j != -1:
            path.insert(0, j)
            j = tree.parents[j]
        paths.append(path)
    return paths or [[]]


def verify_tree_paths(target, layer_ids, cache, anchor: int, tree: Tree, p: int, rule: Rule,
                      clock=None) -> Verdict:
    """The tree as a batch of its root-to-leaf paths; the row of the accepted path is the cache kept."""
    paths = tree_paths(tree)
    width = 1 + max(len(path) for path in paths)
    rows = [[anchor] + [tree.tokens[i] for i in path] for path in paths]
    ids = torch.tensor([row + row[-1:] * (width - len(row)) for row in rows], device=target.device)  # (pad: unread)
    where = {-1: (0, 0)}
    for r, path in enumerate(paths):
        for t, node in enumerate(path, start=1):
            where.setdefault(node, (r, t))
    entries = list(where)  # -1 (the root) first, then nodes as the paths first reach them
    recorder = StateRecorder(target, [where[node] for node in entries]) if target.is_hybrid and width > 1 else None
    select_rows(cache, torch.zeros(len(paths), dtype=torch.long, device=target.device))
    _lap(clock, "other")
    with recorder.recording() if recorder else nullcontext():
        out = target_forward(target, ids, layer_ids, cache=cache, logits_to_keep=0)
    _lap(clock, "verify")
    accepted, nodes, bonus = _walk(tree, lambda node: out.logits[where[node][0], where[node][1]][None], p, rule)
    last = nodes[-1] if nodes else -1
    row, t = where[last]
    select_rows(cache, torch.tensor([row], device=target.device))
    commit(cache, p, t + 1, width, recorder.state(entries.index(last)) if recorder else None)
    return Verdict(accepted, bonus, out.features[row: row + 1, : t + 1], ids.numel())
