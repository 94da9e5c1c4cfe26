"""Live speculative decoding with a DFlash drafter: the target in the loop.

Each step drafts a block [x_p, d_1..d_{B-1}] from the context features of positions < p,
verifies it with one target forward, commits the accepted drafts plus the target's bonus
token, and feeds the new positions' features to the drafter's context cache. Target caches:
attention layers are cropped to the committed length; linear-attention (Gated DeltaNet)
layers cannot be cropped, so their states are snapshotted before verification and, when a
draft is rejected, restored and the accepted tokens replayed. DDTree verification (a tree of
drafts in one forward, ancestor-only attention) needs an attention-only target.

Sampling (temperature > 0) draws the target's token at absolute position t from a generator
seeded by (seed, t), so speculative and plain decoding make the same draws: the output must
match plain decoding token for token at any temperature.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dflash.drafter.blocks import draft_block
from dflash.drafter.ddtree import build_tree
from dflash.target.features import target_forward
from dflash.target.loading import Target, as_target


@dataclass
class SpecResult:
    output_ids: torch.Tensor
    """[1, prompt + generated]."""
    acceptance_lengths: list[int]
    """Tokens committed per verification step (accepted drafts + 1 bonus, none past a stop token), in [1, B];
    they sum to the generated tokens less the prefill's one."""
    target_forwards: int = 1
    """Target forwards, the prompt's (prefill) included: 1 + verifications + replays (hybrid targets),
    so generated tokens / target_forwards is 1.0 for plain decoding and for drafts never accepted."""
    replays: int = 0
    draft_tokens: list[list[int]] = field(default_factory=list)


def _position_seed(seed: int, position: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest(), "little") >> 1


def choose(logits: torch.Tensor, temperature: float, seed: int, first_position: int) -> torch.Tensor:
    """The target's token for each row of logits [n, V]; row i is absolute position first_position + i."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    out = []
    for i in range(probs.shape[0]):
        g = torch.Generator(device=probs.device).manual_seed(_position_seed(seed, first_position + i))
        out.append(torch.multinomial(probs[i], 1, generator=g))
    return torch.cat(out)


def _new_cache(target: Target):
    """A cache that can be rolled back exactly: attention layers keep every position, sliding-window
    ones included (a sliding layer's own cache drops what falls out of the window, so a rejected
    draft could not be undone; the window itself is applied by the model's mask, not the cache)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=target.config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def _linear_layers(cache) -> list:
    return [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]


def _snapshot(cache) -> list[dict]:
    """Copies of every linear-attention layer's conv/recurrent state (attention layers are cropped)."""
    snap = []
    for layer in _linear_layers(cache):
        snap.append({attr: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in getattr(layer, attr).items()}
                     for attr in ("conv_states", "recurrent_states", "has_previous_state")})
    return snap


def _restore(cache, snap: list[dict]) -> None:
    for layer, saved in zip(_linear_layers(cache), snap):
        for attr, values in saved.items():
            setattr(layer, attr, dict(values))


def _attention_layers(cache) -> list:
    return [layer for layer in cache.layers if not hasattr(layer, "recurrent_states")]


def _crop_attention(cache, length: int) -> None:
    """Drop the attention KV of positions >= length, through the cache layers' own crop."""
    for layer in _attention_layers(cache):
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def _keep_attention(cache, keep: torch.Tensor) -> None:
    """Keep only the KV entries at indices `keep` (the accepted path of a verified tree). Attention
    layers are full DynamicLayers here (see _new_cache): keys and values are all they hold."""
    for layer in _attention_layers(cache):
        if layer.get_seq_length():
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def tree_attention_mask(parents: list[int], past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n+1, past+n+1] additive mask for verifying a tree rooted at position `past`: every
    query sees the `past` cached positions, the root and its own ancestors, nothing else. Additive
    (0 / dtype min), so eager attention masks it too (a boolean mask is added to its scores as 0/1)."""
    n = len(parents)
    seen = torch.zeros(n + 1, past + n + 1, dtype=torch.bool, device=device)
    seen[:, : past + 1] = True  # the cache and the root x_p
    for i in range(n):
        j = i
        while j != -1:
            seen[i + 1, past + 1 + j] = True
            j = parents[j]
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                    seed: int = 0, stop_token_ids: list[int] | None = None) -> torch.Tensor:
    """Plain decoding, one token per target forward, through the same feature function."""
    target = as_target(target)
    stops = set(stop_token_ids or [])
    cache = _new_cache(target)
    out = target_forward(target, input_ids, [], cache=cache, logits_to_keep=1)
    ids = input_ids[0].tolist()
    while True:
        token = int(choose(out.logits[0, -1:], temperature, seed, len(ids))[0])
        ids.append(token)
        if len(ids) - input_ids.shape[1] >= max_new_tokens or token in stops:
            break
        out = target_forward(target, torch.tensor([[token]], device=input_ids.device), [], cache=cache,
                             logits_to_keep=1)
    return torch.tensor([ids], device=input_ids.device)


@torch.no_grad()
def speculative_generate(drafter, target, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                         tree_budget: int | None = None, stop_token_ids: list[int] | None = None,
                         seed: int = 0) -> SpecResult:
    """Speculative decoding of one prompt (input_ids [1, P]) with a DFlash drafter.

    `drafter`: a DFlashDraftModel (e.g. from DFlashDraftModel.from_pretrained); `target`: a dflash
    Target or any loaded HF causal LM. tree_budget: verify the DDTree of that many nodes
    (attention-only targets; dflash.drafter.ddtree) instead of the single drafted path.
    """
    target = as_target(target)
    refusal = target.tree_verification_refusal() if tree_budget is not None else None
    if refusal:
        raise ValueError(f"DDTree verification needs a target whose layers are all full attention: {refusal}. "
                         f"Use tree_budget=None")
    drafter.eval()
    stops = set(stop_token_ids or [])
    layer_ids = drafter.target_layer_ids
    embed, head = target.embed_tokens, target.lm_head
    cache, dcache = _new_cache(target), drafter.new_cache()
    prompt_len = input_ids.shape[1]
    out = target_forward(target, input_ids, layer_ids, cache=cache, logits_to_keep=1)
    ids = input_ids[0].tolist()
    ids.append(int(choose(out.logits[0, -1:], temperature, seed, prompt_len)[0]))
    pending = out.features  # context features not yet in the drafter's cache (positions < p)
    result = SpecResult(output_ids=input_ids, acceptance_lengths=[])
    dtype = next(drafter.parameters()).dtype
    while len(ids) - prompt_len < max_new_tokens and ids[-1] not in stops:
        p = len(ids) - 1
        anchor_token = torch.tensor([ids[-1]], device=input_ids.device)
        hidden = draft_block(drafter, embed, pending.to(dtype), anchor_token, p, cache=dcache)
        logits = head(hidden[0, 1:].to(head.weight.dtype)).float()
        room = max_new_tokens - (len(ids) - prompt_len)  # tokens still allowed, the bonus included
        if tree_budget is None:
            drafts = choose(logits, temperature, seed + 1, p + 1)[: room - 1].tolist() if room > 1 else []
            accepted, bonus, features = _verify_path(target, layer_ids, cache, ids[-1], drafts, p, temperature, seed,
                                                     result)
        else:
            accepted, bonus, features, drafts = _verify_tree(target, layer_ids, cache, ids[-1], logits, p,
                                                             tree_budget, room, temperature, seed)
            result.target_forwards += 1
        result.draft_tokens.append(drafts)
        ids.extend(accepted + [bonus])
        pending = features
        for i, t in enumerate(ids[p + 1:], start=p + 1):  # stop at the first stop token committed
            if t in stops:
                del ids[i + 1:]
                break
        result.acceptance_lengths.append(len(ids) - 1 - p)  # what was kept: nothing past a stop token counts
    result.output_ids = torch.tensor([ids[: prompt_len + max_new_tokens]], device=input_ids.device)
    return result


def _verify_path(target, layer_ids, cache, anchor_token, drafts, p, temperature, seed, result):
    """Verify [x_p, d_1..d_m] in one forward; leave the cache holding exactly positions <= p + accepted."""
    snap = _snapshot(cache) if target.is_hybrid else None
    block = torch.tensor([[anchor_token] + drafts], device=target.device)
    out = target_forward(target, block, layer_ids, cache=cache, logits_to_keep=0)
    result.target_forwards += 1
    post = choose(out.logits[0], temperature, seed, p + 1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == post[a]:
        a += 1
    features = out.features[:, : a + 1]
    if snap is not None and a < len(drafts):  # linear states saw rejected drafts: restore, replay the kept ones
        _restore(cache, snap)
        _crop_attention(cache, p)
        replay = target_forward(target, block[:, : a + 1], layer_ids, cache=cache)
        features = replay.features
        result.target_forwards += 1
        result.replays += 1
    else:
        _crop_attention(cache, p + a + 1)
    return drafts[:a], post[a], features


def _verify_tree(target, layer_ids, cache, anchor_token, logits, p, budget, room, temperature, seed):
    """Verify the DDTree of `budget` nodes (dflash.drafter.ddtree), rooted at x_p, in one forward with an
    ancestor-only mask (attention-only targets). Returns the drafted path (argmax per slot) as drafts."""
    depth = max(0, min(logits.shape[0], room - 1))
    logp = torch.log_softmax(logits[:depth], -1)
    top = logp.topk(min(max(budget, 1), logp.shape[-1]), dim=-1)
    tree = build_tree(top.indices.tolist(), top.values.tolist(), budget, max_depth=depth)
    past = p  # cache holds positions < p
    mask = tree_attention_mask(tree.parents, past, target.dtype, target.device)
    tokens = torch.tensor([[anchor_token] + tree.tokens], device=target.device)
    positions = torch.tensor([[p] + [p + d for d in tree.depths]], device=target.device)
    out = target_forward(target, tokens, layer_ids, attention_mask=mask, position_ids=positions, cache=cache,
                         logits_to_keep=0)
    children = {(par, tok): i for i, (par, tok) in enumerate(zip(tree.parents, tree.tokens))}
    node, path, accepted = -1, [0], []
    while True:
        choice = int(choose(out.logits[0, node + 1: node + 2], temperature, seed, p + 1 + len(accepted))[0])
        nxt = children.get((node, choice))
        if nxt is None:
            bonus = choice
            break
        accepted.append(choice)
        path.append(nxt + 1)
        node = nxt
    keep = torch.cat([torch.arange(past, device=target.device), past + torch.tensor(path, device=target.device)])
    _keep_attention(cache, keep)
    return accepted, bonus, out.features[:, path], logits[:depth].argmax(-1).tolist()  # the drafted path
