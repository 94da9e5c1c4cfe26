"""Live speculative decoding with a DFlash drafter: the target in the loop.

Each step drafts a block [x_p, d_1..d_{B-1}] from the context features of positions < p,
verifies it (or the DDTree built from its distributions) with one target forward
(dflash.drafter.decoding.verify), commits the accepted drafts plus the target's bonus token, and feeds the
new positions' features to the drafter's context cache. The target's cache then holds exactly the
committed text: attention layers are cropped, linear-attention (Gated DeltaNet) layers take the
states recorded at the last accepted position during verification (dflash.drafter.decoding.states), so a
hybrid target too needs one forward per block, no replay.

Sampling (temperature > 0, with top-p / top-k: dflash.drafter.decoding.sampling) drafts from the drafter's distribution
after the target's transform and verifies by rejection sampling (dflash.drafter.decoding.rules): the output is
distributed exactly as plain sampling's (tests/drafter/decoding/test_lossless_sampling.py shows it statistically).
verifier="seeded" instead draws the target's token at position t from a generator seeded by (seed, t), as
`greedy_generate` does, and accepts exact matches: the output then equals plain decoding token for token.

Timing (`Clock`, asked for by passing one): a decoding's wall-clock split into the target's prefill, the drafter's
work per step (its forward, head and selector, the drafts or the DDTree built from them), the target's verification
forward, and the rest (acceptance, cache trimming, masks, stop checks); plain decoding's into its prefill and its
one-token forwards. On CUDA a clock synchronises the device at each split, as timing kernels launched asynchronously
needs; without a clock nothing synchronises beyond what decoding itself reads back.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from dflash.data.stops import StopStrings
from dflash.drafter.blocks import draft_block
from dflash.drafter.decoding.ddtree import Tree, build_tree, build_tree_pairwise
from dflash.drafter.decoding.rules import Rule, make_rule, plain_sample
from dflash.drafter.decoding.sampling import Sampling, SelectorDraw, probs, selector_rows
from dflash.drafter.decoding.states import new_cache, settle
from dflash.drafter.decoding.verify import verify_chain, verify_tree_paths, verify_tree_sequence
from dflash.drafter.dflash2 import beam_path, selector_tables, walk_path
from dflash.target.features import target_forward
from dflash.target.loading import as_target


class Clock:
    """Wall-clock seconds of a decoding by part, `seconds[part]`, and how often each part ran, `counts[part]`.

    `lap(part)` charges the time since the last lap (or `start`) to `part`, so the parts add up to the time between
    `start` and the last lap, nothing counted twice or left out. One clock may time many decodings: the parts add up
    across them (each decoding calls `start` on entry). On CUDA each lap first waits for the device
    (torch.cuda.synchronize): kernels run asynchronously, and a lap without it would charge a forward to whichever
    part next reads a result back. Decoding reads each step's tokens back anyway, so the waits cost little."""

    def __init__(self, device: torch.device | str | None = None, on: bool = True):
        self.on = on
        self.cuda = on and device is not None and torch.device(device).type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.last = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        if self.on:
            self.last = self._now()

    def lap(self, part: str) -> None:
        if not self.on:
            return
        now = self._now()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.counts[part] = self.counts.get(part, 0) + 1
        self.last = now


OFF = Clock(on=False)
"""The clock of a decoding nobody times: every lap returns at once, nothing synchronises."""


@dataclass
class SpecResult:
    output_ids: torch.Tensor
    """[1, prompt + generated]."""
    acceptance_lengths: list[int]
    """Tokens committed per verification step (accepted drafts + 1 bonus, none past a stop token), in [1, B];
    they sum to the generated tokens less the prefill's one."""
    target_forwards: int = 1
    """Target forwards, the prompt's (prefill) included: 1 + verifications (hybrid targets too), so generated
    tokens / target_forwards is 1.0 for plain decoding and for drafts never accepted."""
    verify_tokens: int = 0
    """Tokens the verification forwards processed: 1 + drafts per chain block, 1 + N per tree in one sequence,
    paths x (1 + depth) per tree verified as a batch of paths (dflash.drafter.decoding.verify)."""
    draft_tokens: list[list[int]] = field(default_factory=list)


@torch.no_grad()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                    seed: int = 0, stop_token_ids: list[int] | None = None, top_p: float = 1.0,
                    top_k: int = 0, stop_strings: list[str] | None = None, clock: Clock | None = None) -> torch.Tensor:
    """Plain decoding, one token per target forward, through the same feature function: greedy, or at
    temperature > 0 the token at position t drawn by the generator of (seed, t) (dflash.drafter.decoding.rules). Stops
    after max_new_tokens, a stop token, or the token that completes one of `stop_strings` (dflash.data.stops).
    clock: times the decoding into `prefill` (the prompt's forward and first token) and `decode` (each one-token
    forward with its sampling: counts["decode"] of them)."""
    clock = clock or OFF
    clock.start()
    target = as_target(target)
    sampling = Sampling(temperature, top_p, top_k)
    stops, strings = set(stop_token_ids or []), stop_strings_of(target, stop_strings)
    cache = new_cache(target, recording=False)
    out = target_forward(target, input_ids, [], cache=cache, logits_to_keep=1)
    ids = input_ids[0].tolist()
    part = "prefill"  # the first token comes from the prompt's forward, each later one from a one-token forward
    while True:
        token = plain_sample(out.logits[0, -1:], sampling, seed, len(ids))[0]
        ids.append(token)
        clock.lap(part)
        part = "decode"
        if len(ids) - input_ids.shape[1] >= max_new_tokens or token in stops or (
                strings and strings.first(ids, len(ids) - 1) is not None):
            break
        out = target_forward(target, torch.tensor([[token]], device=input_ids.device), [], cache=cache,
                             logits_to_keep=1)
    return torch.tensor([ids], device=input_ids.device)


@torch.no_grad()
def speculative_generate(drafter, target, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                         tree_budget: int | None = None, stop_token_ids: list[int] | None = None,
                         seed: int = 0, tree: str = "marginal", top_p: float = 1.0, top_k: int = 0,
                         verifier: str = "rejection", stop_strings: list[str] | None = None,
                         selector_draw: str = "candidates", selector_truncation: bool = False,
                         selector_beam: int = 1, clock: Clock | None = None) -> SpecResult:
    """Speculative decoding of one prompt (input_ids [1, P]) with a DFlash drafter.

    `drafter`: a DFlashDraftModel (e.g. from DFlashDraftModel.from_pretrained); `target`: a dflash
    Target or any loaded HF causal LM. tree_budget: verify the DDTree of that many nodes
    (dflash.drafter.decoding.ddtree) instead of the single drafted path, on any target: in one sequence under an
    ancestor-only mask, or on hybrid targets as a batch of its paths (`Target.tree_verification`).
    A DFlash 2 drafter drafts its candidate selector's path (dflash.drafter.dflash2); tree="pairwise" builds
    its DDTree from the selector's pairwise scores (a child conditioned on its parent's token) instead of the
    per-slot marginals ("marginal").
    temperature, top_p, top_k: the sampling transform of target and drafter alike (dflash.drafter.decoding.sampling),
    but a DFlash 2 drafter draws as `selector_draw` says (candidates: among its K candidates from softmax(score / T), as
    the reference decoder does; vocabulary; unary: dflash.drafter.decoding.sampling.SelectorDraw) and applies top_p /
    top_k to its draw only with selector_truncation=True. selector_beam > 1: a DFlash 2 drafter's greedy chain is the
    one a beam of that width finds over its pairwise scores (dflash.drafter.dflash2.beam_path), not its greedy walk.
    verifier: rejection (speculative sampling, the default), seeded (exact match of seeded draws: output equal
    to greedy_generate's with the same seed) or exact_match (greedy drafts accepted when they equal the target's
    sample, as the reference benchmark's temperature-1 tables), dflash.drafter.decoding.rules. seed: the run's
    randomness. Decoding stops after max_new_tokens, a stop token of stop_token_ids, or the token that completes one of
    stop_strings (as `generate` stops on them: dflash.data.stops; needs the target's tokenizer), nothing after it
    kept or counted.
    clock: times the decoding into `prefill` (the prompt's target forward and first token), `draft` (per step: the
    drafter's forward, its logits through the target's head, DFlash 2's selector, the drafts or the DDTree),
    `verify` (per step: the target's verification forward, hybrid targets' state recording included) and `other`
    (acceptance, cache trimming, tree masks, stop checks, setup); the parts add up to the call's time.
    """
    clock = clock or OFF
    clock.start()
    target = as_target(target)
    drafter.eval()
    sampling = Sampling(temperature, top_p, top_k)
    rule = make_rule(sampling, verifier, seed, input_ids.device)
    stops, strings = set(stop_token_ids or []), stop_strings_of(target, stop_strings)
    layer_ids = drafter.target_layer_ids
    embed, head = target.embed_tokens, target.lm_head
    cache, dcache = new_cache(target, recording=target.is_hybrid), drafter.new_cache()
    prompt_len = input_ids.shape[1]
    clock.lap("other")
    out = target_forward(target, input_ids, layer_ids, cache=cache, logits_to_keep=1)
    settle(cache)
    ids = input_ids[0].tolist()
    ids.append(rule.sample(out.logits[0, -1], prompt_len))
    clock.lap("prefill")
    pending = out.features  # context features not yet in the drafter's cache (positions < p)
    result = SpecResult(output_ids=input_ids, acceptance_lengths=[])
    dtype = next(drafter.parameters()).dtype
    if tree not in ("marginal", "pairwise"):
        raise ValueError(f"tree={tree!r}: marginal or pairwise")
    if tree == "pairwise" and drafter.candidate_selector is None:
        raise ValueError("tree='pairwise' builds the DDTree from DFlash 2's selector; this drafter is DFlash 1")
    verify_tree = verify_tree_sequence if target.tree_verification() == "sequence" else verify_tree_paths

    draw = SelectorDraw(selector_draw, selector_truncation)
    stopped = False
    while len(ids) - prompt_len < max_new_tokens and ids[-1] not in stops and not stopped:
        p = len(ids) - 1
        anchor_token = torch.tensor([ids[-1]], device=input_ids.device)
        hidden = draft_block(drafter, embed, pending.to(dtype), anchor_token, p, cache=dcache)
        logits = drafter.scales.logits(hidden[0, 1:], head.weight)
        room = max_new_tokens - (len(ids) - prompt_len)  # tokens still allowed, the bonus included
        tables = None
        if drafter.candidate_selector is not None and (tree_budget is None or tree == "pairwise"):
            # DFlash 2's chain and pairwise tree: one batched product, then the walk on the host
            tables = [t[0] for t in selector_tables(drafter.candidate_selector, hidden[:, 1:], logits[None],
                                                    anchor_token)]
        if tree_budget is None:
            rescore = None
            if tables is not None and draw.over == "vocabulary":  # a predecessor outside the candidates: rescored
                rescore = functools.partial(slot_scores, drafter.candidate_selector, hidden[0, 1:], logits, tables[0])
            drafts, q = draft_chain(logits, tables, room - 1, rule, p, draw, rescore, selector_beam)
            clock.lap("draft")
            verdict = verify_chain(target, layer_ids, cache, ids[-1], drafts, p, rule, q, clock=clock)
        else:
            if tree == "pairwise":
                draft, drafts = draft_tree_pairwise(tables, tree_budget, room)
            else:
                draft, drafts = draft_tree(logits, tree_budget, room)
            clock.lap("draft")
            verdict = verify_tree(target, layer_ids, cache, ids[-1], draft, p, rule, clock=clock)
        result.target_forwards += 1
        result.verify_tokens += verdict.tokens
        result.draft_tokens.append(drafts)
        ids.extend(verdict.accepted + [verdict.bonus])
        pending = verdict.features
        # stop at the first stop token committed, or the first token that completes a stop string
        end = next((i for i in range(p + 1, len(ids)) if ids[i] in stops), None)
        hit = strings.first(ids[: len(ids) if end is None else end], p + 1) if strings else None
        if hit is not None:
            end, stopped = hit, True
        if end is not None:
            del ids[end + 1:]
        result.acceptance_lengths.append(len(ids) - 1 - p)  # what was kept: nothing past a stop token counts
        clock.lap("other")
    result.output_ids = torch.tensor([ids[: prompt_len + max_new_tokens]], device=input_ids.device)
    clock.lap("other")
    return result


def stop_strings_of(target, strings) -> StopStrings | None:
    """The stop strings' checker for the target's tokenizer (`strings` a list, or a StopStrings built once for
    many decodings), or None without strings."""
    if isinstance(strings, StopStrings):
        return strings or None
    if not strings:
        return None
    if target.tokenizer is None:
        raise ValueError("stop_strings need the target's tokenizer: pass a dflash Target, or "
                         "dflash.target.loading.as_target(model, tokenizer)")
    return StopStrings(target.tokenizer, strings)


def draft_chain(logits: torch.Tensor, tables, depth: int, rule: Rule, p: int, draw: SelectorDraw | None = None,
                rescore=None, beam: int = 1) -> tuple[list[int], torch.Tensor | None]:
    """The drafted chain of one block (at most `depth` tokens) and, for a rule that reads it, the distributions
    [depth, V] it was drawn from (else None).

    logits [S, V]: the drafter's slots 1..S; tables: DFlash 2's selector tables (cand, first, table) or None.
    The rule says how drafts are made (dflash.drafter.decoding.rules): the argmax per slot (DFlash 2: the selector's
    best walk), or each slot drawn by the rule from the drafter's distribution after the rule's transform. DFlash 2
    draws its chain slot by slot as `draw` says (dflash.drafter.decoding.sampling.SelectorDraw, default: among the K
    candidates from softmax(score / T) after the previous draw, q zero off them). draw.over = "vocabulary" may
    draw a token outside the previous slot's candidates, whose row the tables lack: rescore(slot, token) gives
    the slot's candidate scores after any predecessor (`slot_scores`). beam > 1: DFlash 2's greedy chain is the
    beam's (dflash.drafter.dflash2.beam_path) instead of its greedy walk.
    """
    depth = max(0, min(depth, logits.shape[0]))
    draw = draw or SelectorDraw()
    if depth == 0:
        return [], None
    if rule.greedy_drafts:
        if tables is None:
            return logits[:depth].argmax(-1).tolist(), None
        return (beam_path(*tables, depth=depth, width=beam) if beam > 1 else walk_path(*tables, depth=depth)), None
    if tables is None or draw.over == "unary":
        q = probs(logits[:depth], rule.sampling if tables is None else draw.sampling(rule.sampling))
        return rule.draw_drafts(q, p + 1), (q if rule.reads_q else None)
    cand, first, table = tables
    rows = []
    if draw.over == "vocabulary":
        drafts = []
        for s in range(depth):
            scores = first
            if s:  # after the previous draft: the tables' row when it is a candidate, else rescored
                at = (cand[s - 1] == drafts[-1]).nonzero().flatten()
                scores = table[s - 1, int(at[0])] if at.numel() else rescore(s, drafts[-1])
            rows.append(selector_rows(draw, logits[s], scores, cand[s], rule.sampling))
            drafts.append(rule.draw_drafts(rows[-1][None], p + 1 + s)[0])
    else:
        def pick(scores: torch.Tensor, s: int) -> int:
            rows.append(selector_rows(draw, logits[s], scores, cand[s], rule.sampling))
            return int((cand[s] == rule.draw_drafts(rows[-1][None], p + 1 + s)[0]).nonzero()[0])

        drafts = walk_path(cand, first, table, depth=depth, draw=pick)
    return drafts, (torch.stack(rows) if rule.reads_q else None)


def slot_scores(selector, hidden: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor, slot: int,
                prev: int) -> torch.Tensor:
    """The selector's scores [K] of slot `slot`'s candidates after the predecessor token `prev` (any token): hidden
    [S, H], logits [S, V] and cand [S, K] of the block's drafted slots."""
    unary = logits[slot].gather(-1, cand[slot])
    return selector.scores(hidden[slot], unary, cand[slot], torch.tensor(prev, device=cand.device))


def draft_tree_pairwise(tables, budget: int, room: int) -> tuple[Tree, list[int]]:
    """The DDTree of `budget` nodes from a DFlash 2 selector's tables (cand [S, K], first [K], table [S-1, K, K]:
    dflash.drafter.dflash2.selector_tables), at most room - 1 deep, and the selector's greedy path."""
    cand, first, table = tables
    depth = max(0, min(cand.shape[0], room - 1))
    first_logp, table_logp = torch.log_softmax(first, -1).tolist(), torch.log_softmax(table, -1).tolist()
    tree = build_tree_pairwise(cand.tolist(), first_logp, table_logp, budget, max_depth=depth)
    return tree, walk_path(cand, first, table, depth=depth)


def draft_tree(logits: torch.Tensor, budget: int, room: int) -> tuple[Tree, list[int]]:
    """The DDTree of `budget` nodes from the drafter's per-slot logits [B-1, V], at most room - 1 deep, and the
    drafted path (argmax per slot) it grew from."""
    depth = max(0, min(logits.shape[0], room - 1))
    logp = torch.log_softmax(logits[:depth], -1)
    top = logp.topk(min(max(budget, 1), logp.shape[-1]), dim=-1)
    tree = build_tree(top.indices.tolist(), top.values.tolist(), budget, max_depth=depth)
    return tree, logits[:depth].argmax(-1).tolist()
