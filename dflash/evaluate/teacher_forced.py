"""Teacher-forced evaluation: every anchor of the held-out completions is drafted with the packed
forward from cached target features, and slot k is scored against x_{p+k} (DESIGN §5).

One record per block goes to blocks.jsonl; summary.json is computed from those records by
`summarize`, so the two always agree. Per-slot accuracy and streaks come from
dflash.drafter.metrics, the same code that scores training batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dflash.drafter import metrics
from dflash.drafter.blocks import draft_packed, eligible_anchors, pack_blocks
from dflash.drafter.ddtree import ddtree_tau
from dflash.io import write_json, write_jsonl
from dflash.tracking import Progress

ANCHORS_PER_FORWARD = 256


@torch.no_grad()
def teacher_forced(drafter, embed, head, eval_set, cfg, backend: str = "sdpa") -> list[dict]:
    """One record per evaluated block: prompt id, anchor, target and draft tokens of slots 1..B-1,
    the drafter's top-K tokens and log-probs per slot (K = the largest DDTree budget), streak."""
    was_training = drafter.training
    drafter.eval()
    B, K = drafter.block_size, max(cfg.ddtree_budgets, default=1)
    device, dtype = embed.weight.device, next(drafter.parameters()).dtype
    records = []
    n_prompts = len(eval_set) if cfg.max_prompts is None else min(cfg.max_prompts, len(eval_set))
    progress = Progress(n_prompts, "teacher-forced eval", "prompts")
    for i in range(n_prompts):
        ids, mask, feats = eval_set[i]
        anchors = eligible_anchors(mask, cfg.anchor_region)
        anchors = anchors[anchors + B - 1 < ids.numel()][:: cfg.anchor_stride]  # complete blocks only
        if cfg.max_blocks is not None:
            anchors = anchors[: cfg.max_blocks]
        label_mask = torch.ones_like(mask) if cfg.anchor_region == "all" else mask
        for s in range(0, anchors.numel(), ANCHORS_PER_FORWARD):
            chunk = anchors[s: s + ANCHORS_PER_FORWARD]
            blocks = pack_blocks(ids[None], label_mask[None], torch.tensor([ids.numel()]), [chunk], B,
                                 drafter.mask_token_id).to(device)
            hidden = draft_packed(drafter, embed, feats[None].to(device, dtype), blocks, backend)[0, :, 1:]
            logp = torch.log_softmax(head(hidden.to(head.weight.dtype)).float(), -1)
            top = logp.topk(K, dim=-1)
            correct, _ = block_correct(top.indices[:, :, 0].cpu(), blocks.labels[0, :, 1:].cpu())
            streak = metrics.streaks(correct).tolist()
            for j, p in enumerate(chunk.tolist()):
                records.append({
                    "prompt_id": eval_set.ids[i], "anchor": p, "target_tokens": ids[p + 1: p + B].tolist(),
                    "draft_tokens": top.indices[j, :, 0].tolist(), "topk_ids": top.indices[j].tolist(),
                    "topk_logprobs": top.values[j].tolist(), "streak": int(streak[j]),
                })
        progress.update()
    progress.close()
    drafter.train(was_training)
    return records


def block_correct(draft: torch.Tensor, target: torch.Tensor):
    """(correct, valid) [n, B-1] of drafted slots 1..B-1 against the target's, through
    metrics.slot_correct (slot 0, the given token, is never scored)."""
    n = draft.shape[0]
    pad = torch.full((n, 1), -1, dtype=torch.long)
    predictions, labels = torch.cat([pad, draft.long()], 1), torch.cat([pad, target.long()], 1)
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    label_mask[:, 0] = False
    return metrics.slot_correct(predictions, labels, label_mask)


def summarize(records: list[dict], block_size: int, budgets: list[int], prefix: str = "eval") -> dict:
    """Micro (per block) and macro (per prompt) means, the tau histogram and a per-prompt table."""
    if records:
        correct, _ = block_correct(torch.tensor([r["draft_tokens"] for r in records]),
                                   torch.tensor([r["target_tokens"] for r in records]))
        streak = metrics.streaks(correct).tolist()
    stats = []
    for n, r in enumerate(records):
        row = {f"acc@{k}": float(c) for k, c in enumerate(correct[n].tolist(), 1)}
        row["streak"] = float(streak[n])
        row["tau"] = streak[n] + 1.0
        row["full"] = float(streak[n] == block_size - 1)  # every drafted token accepted (tau = B)
        for b in budgets:
            row[f"ddtree@{b}"] = float(ddtree_tau(r["topk_ids"], r["topk_logprobs"], r["target_tokens"], b))
        stats.append(row)
    keys = list(stats[0]) if stats else []

    def mean(rows, k):
        return sum(s[k] for s in rows) / max(1, len(rows))

    per_prompt: dict[str, list[dict]] = {}
    for r, s in zip(records, stats):
        per_prompt.setdefault(r["prompt_id"], []).append(s)
    table = {pid: {"blocks": len(rows), **{k: mean(rows, k) for k in keys}} for pid, rows in per_prompt.items()}
    summary = {f"{prefix}/{k}": mean(stats, k) for k in keys}
    summary.update({f"{prefix}/{k}_macro": sum(t[k] for t in table.values()) / max(1, len(table)) for k in keys})
    summary[f"{prefix}/blocks"] = len(records)
    summary[f"{prefix}/prompts"] = len(table)
    return {"metrics": summary, "tau_histogram": metrics.tau_histogram([s["tau"] for s in stats], block_size),
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
