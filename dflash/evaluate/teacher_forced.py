"""Teacher-forced evaluation: blocks of the held-out completions are drafted with the packed forward
from cached target features, and slot k is scored against x_{p+k} (DESIGN §5).

Two estimators come from the same records. The headline one walks each completion as decoding does
(dflash.evaluate.walk: a block where the previous one stopped), which equals live decoding on the same
completions; the every-anchor mean (`*_all_anchors`, and the slot accuracies) drafts a block at every
response position and is what training's sampled anchors estimate. One record per drafted block goes
to blocks.jsonl; summary.json is computed from those records by `summarize`, so the two always agree.
Per-slot accuracy and streaks come from dflash.drafter.metrics, the same code that scores training batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dflash.data.prompts import conversation_id
from dflash.data.tools import tool_items
from dflash.drafter import metrics
from dflash.drafter.blocks import draft_packed, eligible_anchors, pack_blocks
from dflash.drafter.decoding.ddtree import accepted_length, build_tree_pairwise, ddtree_tau
from dflash.drafter.decoding.sampling import (Sampling, SelectorDraw, probs, selector_rows, stored_acceptance,
                                              stored_probs)
from dflash.drafter.dflash2 import beam_path
from dflash.errors import CacheError
from dflash.evaluate.slices import slice_metrics
from dflash.evaluate.walk import (accepted_weights, alpha_weights, expected_blocks, span, variant_key, verify_depth,
                                  walk, walk_variants)
from dflash.io import write_json, write_jsonl
from dflash.tracking import Progress

ANCHORS_PER_FORWARD = 256


@torch.no_grad()
def teacher_forced(drafter, embed, head, eval_set, cfg, backend: str = "sdpa") -> list[dict]:
    """One record per drafted block, by prompt and anchor: target and draft tokens of slots 1..B-1, the
    drafter's top-K tokens and log-probs per slot (K = the largest DDTree budget), streak, `left` and `room`
    (dflash.evaluate.walk), `all_anchors` (a complete block of the every-anchor mean, thinned by
    eval.anchor_stride and eval.max_blocks), `walk_start` (the first response position, where decoding
    drafts its first block) and, for a tool turn the held-out set's manifest lists (dflash.data.tools), `tools`.

    Blocks are drafted at every anchor the every-anchor mean samples and at every position the decoding
    walk reaches (the chain's and each DDTree budget's): by default every response position, the last
    partial blocks included, ANCHORS_PER_FORWARD a forward. On flex every forward is padded to that many
    blocks and a multiple of FLEX_LENGTH_MULTIPLE positions, so an evaluation compiles at most one graph
    per length bucket and mask kind (as training does with train.num_anchors).

    At eval.decode.temperature > 0 every record also carries `alpha`, the acceptance probability of each slot
    under rejection sampling, sum_x min(p(x), q(x)) of the target's transformed distribution p there (stored in the
    held-out set) and the drafter's q (DFlash 2: the selector's over its K candidates after the gold previous
    token), 0 past the completion; blocks are then drafted at every response position (the expected walk
    reads them all: dflash.evaluate.walk.expected_blocks)."""
    was_training = drafter.training
    dec = cfg.decode
    sampling = Sampling(dec.temperature, dec.top_p, dec.top_k)
    draw = SelectorDraw(dec.selector_draw, dec.selector_truncation)
    if not sampling.greedy and not getattr(eval_set, "topk_logits", 0):
        raise CacheError(f"eval.decode.temperature={dec.temperature}: the expected acceptance needs the target's "
                         f"next-token distributions, and this held-out set stores none (it was made for greedy "
                         f"evaluation); let evaluation make the sampled held-out set (drop eval.features_dir), or set "
                         f"eval.decode.temperature=0")
    drafter.eval()
    selector = drafter.candidate_selector
    B, K = drafter.block_size, max(cfg.ddtree_budgets, default=1)
    device, dtype = embed.weight.device, next(drafter.parameters()).dtype
    records = []
    tool_turns = tool_items(getattr(eval_set, "manifest", {}).get("data", {}))  # eval.slices' tools
    items = range(len(eval_set))
    if cfg.max_prompts is not None:  # at most eval.max_prompts prompts, every turn of each conversation
        kept = set(list(dict.fromkeys(conversation_id(pid) for pid in eval_set.ids))[: cfg.max_prompts])
        items = [i for i in items if conversation_id(eval_set.ids[i]) in kept]
    progress = Progress(len(items), "teacher-forced eval", "requests")
    for i in items:
        ids, mask, feats = eval_set[i]
        length = ids.numel()
        response = mask.nonzero().flatten()
        start = int(response[0]) if response.numel() else length
        sampled = eligible_anchors(mask, cfg.anchor_region)
        sampled = sampled[sampled + B - 1 < length][:: cfg.anchor_stride]  # complete blocks only
        if cfg.max_blocks is not None:
            sampled = sampled[: cfg.max_blocks]
        label_mask = torch.ones_like(mask) if cfg.anchor_region == "all" else mask
        by_anchor: dict[int, dict] = {}
        stored = None if sampling.greedy else eval_set.topk(i)

        def draft(anchors: list[int]) -> None:
            anchors = sorted(set(anchors) - set(by_anchor))
            for s in range(0, len(anchors), ANCHORS_PER_FORWARD):
                chunk = torch.tensor(anchors[s: s + ANCHORS_PER_FORWARD], dtype=torch.long)
                blocks = pack_blocks(ids[None], label_mask[None], torch.tensor([length]), [chunk], B,
                                     drafter.mask_token_id).to(device)
                hidden = draft_packed(drafter, embed, feats[None].to(device, dtype), blocks, backend,
                                      num_blocks=ANCHORS_PER_FORWARD)[0, :, 1:]
                logits = drafter.scales.logits(hidden, head.weight)
                logp = torch.log_softmax(logits, -1)
                top = logp.topk(K, dim=-1)
                # a partial block's slots past the completion hold -1: never a drafted token
                target = blocks.labels[0, :, 1:].cpu().masked_fill(~blocks.label_mask[0, :, 1:].cpu(), -1)
                drafted, selected = top.indices[:, :, 0], None
                if selector is not None:  # DFlash 2 drafts the selector's path; the argmax path is the unary one
                    drafted, extra, tables, selected = dflash2_fields(selector, hidden, logits, blocks, target)
                if stored is not None:
                    alpha, accept = (t.tolist() for t in slot_rates(logits, selected, stored, chunk, target, sampling,
                                                                     draw))
                correct, _ = block_correct(drafted.cpu(), target)
                streak = metrics.streaks(correct).tolist()
                draft_ids, top_ids, top_logp = drafted.tolist(), top.indices.tolist(), top.values.tolist()
                for j, p in enumerate(chunk.tolist()):
                    by_anchor[p] = {
                        "prompt_id": eval_set.ids[i], "anchor": p, "target_tokens": ids[p + 1: p + B].tolist(),
                        "draft_tokens": draft_ids[j], "topk_ids": top_ids[j], "topk_logprobs": top_logp[j],
                        "streak": int(streak[j]), "left": length - 1 - p, "room": start + cfg.max_new_tokens - 1 - p,
                        "all_anchors": False, "walk_start": p == start,
                    }
                    if eval_set.ids[i] in tool_turns:
                        by_anchor[p]["tools"] = True
                    if stored is not None:
                        by_anchor[p].update(alpha=alpha[j], accept=accept[j])
                    if selector is not None:
                        by_anchor[p].update({k: v[j] for k, v in extra.items()})
                        by_anchor[p]["pair_accepted"] = pair_accepted(by_anchor[p], tables[j], cfg.ddtree_budgets)
                        if dec.selector_beam > 1:  # as deep as live decoding drafts there: the beam depends on it
                            by_anchor[p]["beam_tokens"] = beam_path(*map(torch.tensor, tables[j]),
                                                                    depth=verify_depth(by_anchor[p]),
                                                                    width=dec.selector_beam)

        whole_response = cfg.anchor_stride == 1 and cfg.max_blocks is None
        walked = range(start, min(length - 1, start + cfg.max_new_tokens - 1))  # anchors live decoding can reach
        draft(sampled.tolist() + (list(walked) if whole_response or stored is not None else []))
        for p in sampled.tolist():
            by_anchor[p]["all_anchors"] = True
        if start < length - 1:  # what the walks reach beyond those (thinned anchors): B positions at a time
            for variant in walk_variants(cfg.ddtree_budgets, selector is not None, dec.selector_beam > 1):
                walk(by_anchor, start, variant, missing=lambda p: draft(list(range(p, min(p + B, length - 1)))))
        records += [by_anchor[p] for p in sorted(by_anchor)]
        progress.update()
    progress.close()
    drafter.train(was_training)
    return records


def slot_rates(logits: torch.Tensor, selected: tuple | None, stored, anchors: torch.Tensor, target: torch.Tensor,
               sampling: Sampling, draw: SelectorDraw | None = None,
               rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, accept) [n, S] of each block's drafted slots under rejection sampling, 0 past the completion
    (target -1).

    alpha_k = sum_x min(p_k(x), q_k(x)): slot k's acceptance probability, averaged over the draft.
    accept_k = min(1, q_k(x_k) / p_k(x_k)) at the completion's token x_k: the pathwise weight of the unbiased
    expected walk (dflash.evaluate.walk.expected_blocks derives it). A completion token outside the stored
    top-k gets the smallest stored probability as p.

    logits [n, S, V]: the drafter's; selected: DFlash 2's (scores [n, S, K], candidates [n, S, K]), the
    selector's scores over the unary top-K after the gold previous token, drawn as `draw` says (the q live decoding
    draws from after that token: dflash.drafter.decoding.sampling.selector_rows; default the reference's, among the K
    candidates), else None; stored: the prompt's TopK (the target's next-token distribution per position, on the
    host); anchors [n] (host). `rows` anchors at a time: q is [rows, S, V]."""
    n, S, V = logits.shape
    alphas, ratios, draw = [], [], draw or SelectorDraw()
    for s in range(0, n, rows):
        part = logits[s: s + rows]
        if selected is None:
            q = probs(part, sampling)
        else:
            scores, cand = selected
            q = selector_rows(draw, part, scores[s: s + rows], cand[s: s + rows], sampling)
        # slot k of the block at anchor a is predicted by the target at position a + k - 1
        pos = (anchors[s: s + rows, None] + torch.arange(S)).clamp_max(stored.logprobs.shape[0] - 1)
        ids = stored.ids[pos].to(q.device)
        p, rest = stored_probs(stored.logprobs[pos].to(q.device), stored.rest[pos].to(q.device), sampling)
        alphas.append(stored_acceptance(q, ids, p, rest).cpu())
        gold = target[s: s + rows].clamp_min(0).to(q.device)
        hit = ids == gold[..., None]
        p_gold = torch.where(hit.any(-1), (p * hit).sum(-1), p.min(-1).values)
        q_gold = q.gather(-1, gold[..., None])[..., 0]
        ratios.append((q_gold / p_gold.clamp_min(1e-30)).clamp_max(1.0).cpu())
    valid = target >= 0
    return torch.cat(alphas).masked_fill(~valid, 0.0), torch.cat(ratios).masked_fill(~valid, 0.0)


def dflash2_fields(selector, hidden, logits, blocks, target) -> tuple[torch.Tensor, dict, list, tuple]:
    """DFlash 2's drafted tokens [n, S] (the selector's, the gold previous token as predecessor: while they match
    the gold tokens this is the selector's own walk, so their chain streak is the live walk's), per-record fields
    (`unary_tokens`: the argmax path; `oracle_tokens`: the gold token where the unary top-K holds it, else -1, the
    selector's ceiling) and per block the selector's transition tables (candidates, conditional log-probs) for
    its pairwise DDTree, and (scores, candidates) [n, S, K]: the unary top-K's scores after the gold previous
    token. The unary top-K is taken once for all."""
    unary, cand = selector.candidates(logits)
    prev = blocks.labels[0, :, :-1]  # slot k's predecessor is x_{p+k-1}: the anchor token at slot 1
    scores = selector.scores(hidden, unary, cand, prev)
    choice = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    gold = target.to(cand.device)
    held = (cand == gold[..., None]).any(-1) & (gold >= 0)
    oracle = torch.where(held, gold, torch.full_like(gold, -1))
    first, table = selector.transitions(hidden, unary, cand, blocks.labels[0, :, 0])
    first, table = torch.log_softmax(first, -1), torch.log_softmax(table, -1)
    extra = {"unary_tokens": logits.argmax(-1).tolist(), "oracle_tokens": oracle.tolist()}
    return choice, extra, list(zip(cand.tolist(), first.tolist(), table.tolist())), (scores, cand)


def pair_accepted(record: dict, tables: tuple, budgets: list[int]) -> dict:
    """{budget: drafts the selector's pairwise DDTree of that many nodes accepts}, the tree built from the block's
    `tables` (dflash2_fields) at most as deep as live decoding verifies there (dflash.evaluate.walk.verify_depth)."""
    cand, first, table = tables
    depth = verify_depth(record)
    return {str(b): accepted_length(build_tree_pairwise(cand, first, table, b, max_depth=depth),
                                    record["target_tokens"]) for b in budgets}


def block_correct(draft: torch.Tensor, target: torch.Tensor):
    """(correct, valid) [n, B-1] of drafted slots 1..B-1 against the target's, through
    metrics.slot_correct (slot 0, the given token, is never scored)."""
    n = draft.shape[0]
    pad = torch.full((n, 1), -1, dtype=torch.long)
    predictions, labels = torch.cat([pad, draft.long()], 1), torch.cat([pad, target.long()], 1)
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    label_mask[:, 0] = False
    return metrics.slot_correct(predictions, labels, label_mask)


def summarize(records: list[dict], block_size: int, budgets: list[int], prefix: str = "eval",
              slices: dict | None = None) -> dict:
    """Metrics of the records, micro (per block) and macro (per prompt), and a per-prompt table.

    The headline `tau`, `full` and `ddtree@N` are over the decoding walk (dflash.evaluate.walk: the blocks
    live decoding drafts, each scored as it commits; each DDTree budget walks with its own accepted lengths).
    The mean over a block at every sampled anchor is reported under its own name (`tau_all_anchors`,
    `full_all_anchors`, `ddtree@N_all_anchors`), as are the slot accuracies `acc@k`: it is the estimator
    training's random anchors give. The tau histogram is the walk's.

    Records with `alpha` (eval.decode.temperature > 0) add the expected acceptance under rejection sampling:
    `tau_expected`, the completions' tokens over the expected number of blocks of the walk
    (dflash.evaluate.walk.expected_blocks with the pathwise rates of slot_rates: an unbiased estimate of live
    decoding's at that temperature), its `_macro` and its standard error over prompts `_se`;
    `tau_alpha_product`, an approximation: the same walk with the alphas as rates (slots as if independent, the
    token after a rejection the completion's); `alpha@k`, `tau_expected_all_anchors` and
    `tau_alpha_product_all_anchors` (each block's expected accepted length, 1 + sum_k prod_{i<=k} rate_i) at every
    anchor. `tau_se` is the greedy walk tau's standard error. `slices` ({kind: record -> slice name},
    dflash.evaluate.slices): the walk's tau per slice too (`<prefix>/slice/<kind>/<name>/*`).
    """
    every = [r for r in records if r.get("all_anchors", True)]
    dflash2 = bool(records) and "unary_tokens" in records[0]
    sampled = bool(records) and "alpha" in records[0]
    rows, walked, expected, chain_steps = [], [], [], []
    if every:
        correct, _ = block_correct(torch.tensor([r["draft_tokens"] for r in every]),
                                   torch.tensor([r["target_tokens"] for r in every]))
        streak = metrics.streaks(correct).tolist()
        if dflash2:
            unary, _ = block_correct(torch.tensor([r["unary_tokens"] for r in every]),
                                     torch.tensor([r["target_tokens"] for r in every]))
            oracle = metrics.streaks(torch.tensor([[t >= 0 for t in r["oracle_tokens"]] for r in every])).tolist()
    for n, r in enumerate(every):
        row = {f"acc@{k}": float(c) for k, c in enumerate(correct[n].tolist(), 1)}
        row["streak_all_anchors"] = float(streak[n])
        row["tau_all_anchors"] = streak[n] + 1.0
        row["full_all_anchors"] = float(streak[n] == block_size - 1)  # every drafted token accepted (tau = B)
        for b in budgets:
            row[f"ddtree@{b}_all_anchors"] = float(ddtree_tau(r["topk_ids"], r["topk_logprobs"], r["target_tokens"], b))
        if dflash2:  # acc@k is the selector's (the drafted tokens); the argmax path's and the oracle's beside it
            row.update({f"unary_acc@{k}": float(c) for k, c in enumerate(unary[n].tolist(), 1)})
            row["tau_unary_all_anchors"] = metrics.streaks(unary[n]).item() + 1.0
            row["tau_oracle_all_anchors"] = oracle[n] + 1.0
            for b in budgets:
                row[f"ddtree_pair@{b}_all_anchors"] = r["pair_accepted"][str(b)] + 1.0
        if sampled:
            row.update({f"alpha@{k}": a for k, a in enumerate(r["alpha"], 1)})
            for name, rates in (("tau_expected", r["accept"]), ("tau_alpha_product", r["alpha"])):
                weights = accepted_weights(rates, len(rates))
                row[f"{name}_all_anchors"] = sum((j + 1) * w for j, w in enumerate(weights))
        rows.append((r["prompt_id"], row))
    by_prompt: dict[str, dict[int, dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_id"], {})[r["anchor"]] = r
    for pid, by_anchor in by_prompt.items():
        start = next((a for a, r in by_anchor.items() if r.get("walk_start")), None)
        if start is None:  # records of an older evaluation: no walk
            continue
        for variant in walk_variants(budgets, dflash2, "beam_tokens" in records[0]):
            steps = walk(by_anchor, start, variant)
            for _, tau in steps:
                rows.append((pid, {"tau": float(tau), "full": float(tau == block_size)} if variant is None else
                             {variant_key(variant): float(tau)}))
            if variant is None:
                walked.append((sum(tau for _, tau in steps), len(steps)))
                chain_steps += steps
        if sampled and span(by_anchor[start]) >= 1:
            expected.append((pid, span(by_anchor[start]), expected_blocks(by_anchor, start),
                             expected_blocks(by_anchor, start, alpha_weights)))

    def means(rs: list[dict]) -> dict:
        sums, counts = {}, {}
        for row in rs:
            for k, v in row.items():
                sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
        return {k: sums[k] / counts[k] for k in sums}

    per_prompt: dict[str, list[dict]] = {}
    for pid, row in rows:
        per_prompt.setdefault(pid, []).append(row)
    table = {pid: {"blocks": sum("tau" in row for row in rs), "blocks_all_anchors": sum("tau_all_anchors" in row for row in rs),
                   **means(rs)} for pid, rs in per_prompt.items()}
    summary = {f"{prefix}/{k}": v for k, v in means([row for _, row in rows]).items()}
    summary.update({f"{prefix}/{k}_macro": v for k, v in means([{k: v for k, v in t.items() if "blocks" not in k}
                                                               for t in table.values()]).items()})
    summary[f"{prefix}/blocks"] = sum("tau" in row for _, row in rows)
    summary[f"{prefix}/blocks_all_anchors"] = len(every)
    summary[f"{prefix}/prompts"] = len(table)
    summary[f"{prefix}/tau_se"] = metrics.ratio_se(walked)
    for name, col in (("tau_expected", 2), ("tau_alpha_product", 3)) if expected else ():
        pairs = [(e[1], e[col]) for e in expected]
        summary[f"{prefix}/{name}"] = sum(t for t, _ in pairs) / sum(b for _, b in pairs)
        summary[f"{prefix}/{name}_macro"] = sum(t / b for t, b in pairs) / len(pairs)
        summary[f"{prefix}/{name}_se"] = metrics.ratio_se(pairs)
        for e in expected:
            table[e[0]][name] = e[1] / e[col]
    summary.update(slice_metrics(chain_steps, slices or {}, prefix))
    taus = [row["tau"] for _, row in rows if "tau" in row]
    return {"metrics": summary, "tau_histogram": metrics.tau_histogram(taus, block_size),
            "per_prompt": table, "block_size": block_size, "ddtree_budgets": list(budgets)}


def write_outputs(out_dir: Path, records: list[dict], summary: dict, extra: dict | None = None) -> None:
    """summary.json + blocks.jsonl into out_dir; an earlier evaluation there is kept under a dated name."""
    if out_dir.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(out_dir.stat().st_mtime))
        keep, n = out_dir.with_name(f"{out_dir.name}.{stamp}"), 1
        while keep.exists():
            n += 1
            keep = out_dir.with_name(f"{out_dir.name}.{stamp}-{n}")
        out_dir.rename(keep)
    out_dir.mkdir(parents=True)
    write_jsonl(out_dir / "blocks.jsonl", records)
    write_json(out_dir / "summary.json", {**summary, **(extra or {})})
