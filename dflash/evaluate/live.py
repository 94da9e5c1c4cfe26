"""Live evaluation: real speculative decoding on the held-out prompts, checked against plain
decoding of the target token for token, timed side by side."""

from __future__ import annotations

import logging
import time

import torch

from dflash.config import JobConfig
from dflash.data.prompts import encode, load_prompts, prompt_text
from dflash.drafter.metrics import tau_histogram
from dflash.errors import LosslessError
from dflash.evaluate.decode import greedy_generate, speculative_generate
from dflash.target.features import target_forward
from dflash.target.loading import Target
from dflash.tracking import Progress

log = logging.getLogger(__name__)


def _top2_margin(target: Target, ids: list[int], position: int) -> float:
    out = target_forward(target, torch.tensor([ids[:position]], device=target.device), [], logits_to_keep=1)
    top = out.logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def check_lossless(target: Target, prompt_id: str, plain: list[int], spec: list[int], prompt_len: int,
                   tie_margin: float) -> bool:
    """True when equal; False for a divergence at a numerical near-tie (logged); raises otherwise."""
    if plain == spec:
        return True
    pos = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    margin = _top2_margin(target, plain, pos) if pos < min(len(plain), len(spec)) else float("inf")
    where = (f"prompt {prompt_id}: speculative decoding diverged from plain decoding at generated token "
             f"{pos - prompt_len} (plain {plain[pos:pos + 1]}, speculative {spec[pos:pos + 1]}; lengths "
             f"{len(plain) - prompt_len} vs {len(spec) - prompt_len})")
    if margin < tie_margin:
        log.warning("%s, where the target's top-2 logits differ by only %.2e: a numerical tie between batched "
                    "and one-token forwards, not a verification bug", where, margin)
        return False
    raise LosslessError(f"{where}; the target's top-2 logit margin there is {margin:.3g}, far from a tie. The "
                        f"decoding loop is not lossless: this is a bug, please report it")


def live_eval(job: JobConfig, drafter, target: Target) -> tuple[list[dict], dict]:
    """Per-step records and a summary of live decoding (DFlash blocks, and DDTree on attention-only targets)."""
    cfg, data = job.eval, job.data
    prompts = load_prompts(cfg.prompts, limit=cfg.max_prompts)
    tie = cfg.tie_margin if cfg.tie_margin is not None else (1e-3 if target.dtype == torch.float32 else 0.1)
    stops = target.stop_token_ids()
    refusal = target.tree_verification_refusal()
    budgets = [None] + ([n for n in cfg.ddtree_budgets] if refusal is None else [])
    if refusal and cfg.ddtree_budgets:
        log.info("DDTree live verification is skipped for %s: %s", target.path, refusal)
    records, totals = [], {b: {"tokens": 0, "forwards": 0, "verifies": 0, "time": 0.0, "taus": []} for b in budgets}
    plain_time, ties = 0.0, 0
    progress = Progress(len(prompts), "live eval", "prompts")
    for n, prompt in enumerate(prompts):
        text = prompt_text(target.tokenizer, prompt, data.chat_template, data.enable_thinking)
        ids = torch.tensor([encode(target.tokenizer, text)], device=target.device)
        t0 = time.perf_counter()
        plain = greedy_generate(target, ids, cfg.max_new_tokens, cfg.temperature, seed=n, stop_token_ids=stops)
        plain_time += time.perf_counter() - t0
        for budget in budgets:
            t0 = time.perf_counter()
            res = speculative_generate(drafter, target, ids, cfg.max_new_tokens, cfg.temperature, budget, stops, seed=n)
            tot = totals[budget]
            tot["time"] += time.perf_counter() - t0
            ties += not check_lossless(target, prompt.id, plain[0].tolist(), res.output_ids[0].tolist(),
                                       ids.shape[1], tie)
            generated = res.output_ids.shape[1] - ids.shape[1]
            tot["tokens"] += generated
            tot["forwards"] += res.target_forwards
            tot["verifies"] += len(res.acceptance_lengths)
            tot["taus"] += res.acceptance_lengths
            for step, (tau, drafts) in enumerate(zip(res.acceptance_lengths, res.draft_tokens)):
                records.append({"prompt_id": prompt.id, "tree_budget": budget, "step": step, "tau": tau,
                                "draft_tokens": drafts})
        progress.update()
    progress.close()
    base = totals[None]
    metrics = {
        "eval/live_tau": sum(base["taus"]) / max(1, len(base["taus"])),
        "eval/live_tokens_per_forward": base["tokens"] / max(1, base["forwards"]),
        "eval/live_tokens_per_verify": base["tokens"] / max(1, base["verifies"]),
        "eval/live_speedup": plain_time / max(base["time"], 1e-9),
        "eval/live_plain_s": plain_time, "eval/live_spec_s": base["time"],
        "eval/live_prompts": len(prompts), "eval/live_tokens": base["tokens"], "eval/live_ties": ties,
    }
    for b in budgets[1:]:
        metrics[f"eval/live_ddtree@{b}_tau"] = sum(totals[b]["taus"]) / max(1, len(totals[b]["taus"]))
        metrics[f"eval/live_ddtree@{b}_speedup"] = plain_time / max(totals[b]["time"], 1e-9)
    summary = {"metrics": metrics, "tau_histogram": tau_histogram(base["taus"], drafter.block_size),
               "block_size": drafter.block_size, "ddtree_budgets": [b for b in budgets if b], "mode": "live"}
    return records, summary
