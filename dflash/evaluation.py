"""Held-out evaluation: teacher-forced block metrics and live speculative decoding.

Teacher-forced: the held-out prompts' greedy target completions and their features (the eval
cache, made by the same extraction path as training data); every anchor in the completion is
drafted with the packed forward, and slot k is scored against x_{p+k}. One record per block
goes to blocks.jsonl; summary.json is computed from those records by `summarize`, so the two
always agree. Live: `dflash.decode.speculative_generate` with the target in the loop, checked
against plain decoding token for token.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from dflash.blocks import draft_packed, eligible_anchors, pack_blocks
from dflash.cache import CacheError, FeatureCache
from dflash.config import JobConfig
from dflash.ddtree import ddtree_tau
from dflash.metrics import streaks, tau_histogram

log = logging.getLogger(__name__)

ANCHORS_PER_FORWARD = 256


def eval_dirs(job: JobConfig, target, layer_ids: list[int]) -> tuple[Path, Path]:
    """(features dir, completions file) of the held-out set; by default under cache/<target>/.

    Keyed by a hash of the target's weights, tokenizer and dtype (so another checkpoint or dtype
    under the same preset name gets its own set), the prompts and completion length; the
    features dir is per layer set (drafters compared side by side may read different layers).
    """
    import hashlib
    import json

    from dflash.extraction import target_signature

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(job.eval.prompts.removeprefix("builtin:")).stem)
    sig = hashlib.sha256(json.dumps(target_signature(target), sort_keys=True).encode()).hexdigest()[:8]
    base = Path(job.features.dir).parent.parent / f"eval-{name}-n{job.eval.max_new_tokens}-{sig}"
    layers = "L" + "-".join(map(str, layer_ids))
    features = Path(job.eval.features_dir) / layers if job.eval.features_dir else base / f"features-{layers}"
    completions = Path(job.eval.completions_path) if job.eval.completions_path else base / "completions.jsonl"
    return features, completions


def eval_job(job: JobConfig, target, layer_ids: list[int]) -> JobConfig:
    """The job that extracts the held-out set: same target, `layer_ids`, eval prompts, greedy
    completions of eval.max_new_tokens generated one prompt at a time (no padding), untruncated."""
    features_dir, completions = eval_dirs(job, target, layer_ids)
    source = "cached" if job.eval.completions_path else (
        "server" if job.data.completions.source == "server" else "hf")
    comp = replace(job.data.completions, source=source, path=str(completions),
                   max_new_tokens=job.eval.max_new_tokens, batch_size=1)
    data = replace(job.data, name="eval", prompts=job.eval.prompts, format="auto", prompt_key="auto", offset=0,
                   limit=job.eval.max_prompts, max_length=1 << 30, completions=comp)
    return replace(job, data=data, layers=replace(job.layers, ids=list(layer_ids), allow_last_layer=True),
                   features=replace(job.features, dir=str(features_dir), storage="float32"))


def eval_cache_ready(job: JobConfig, target, layer_ids: list[int]) -> bool:
    from dflash.extraction import cache_is_complete

    return cache_is_complete(eval_job(job, target, layer_ids).features)


def ensure_eval_cache(job: JobConfig, target, layer_ids: list[int], dist) -> None:
    from dflash.extraction import extract_with

    if not eval_cache_ready(job, target, layer_ids):
        log.info("extracting the held-out set %s into %s", job.eval.prompts, eval_dirs(job, target, layer_ids)[0])
        extract_with(eval_job(job, target, layer_ids), target, dist)


def load_eval_set(job: JobConfig, target, layer_ids: list[int]) -> FeatureCache:
    """The held-out features; refused if the target now runs other kernels than made them."""
    from dflash.target import kernel_backend

    cache = FeatureCache(eval_dirs(job, target, layer_ids)[0], dtype=torch.float32)
    now = kernel_backend(target.kernels) if target.kernels else None
    if now is not None and cache.manifest["kernel_backend"] != now:
        raise CacheError(f"held-out features in {cache.root} were made with kernels {cache.manifest['kernel_backend']}"
                         f" but the target now runs {now}; delete {cache.root} to recompute them with these kernels")
    return cache


@torch.no_grad()
def teacher_forced(drafter, embed, head, eval_set: FeatureCache, cfg, backend: str = "sdpa") -> list[dict]:
    """One record per evaluated block (see module docstring)."""
    was_training = drafter.training
    drafter.eval()
    B, K = drafter.block_size, max(cfg.ddtree_budgets, default=1)
    device, dtype = embed.weight.device, next(drafter.parameters()).dtype
    records = []
    n_prompts = len(eval_set) if cfg.max_prompts is None else min(cfg.max_prompts, len(eval_set))
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
            for j, p in enumerate(chunk.tolist()):
                target_tokens = ids[p + 1: p + B].tolist()
                draft = top.indices[j, :, 0].tolist()
                records.append({
                    "prompt_id": eval_set.ids[i], "anchor": p, "target_tokens": target_tokens, "draft_tokens": draft,
                    "topk_ids": top.indices[j].tolist(), "topk_logprobs": top.values[j].tolist(),
                    "streak": int(streaks(torch.tensor([d == t for d, t in zip(draft, target_tokens)]))),
                })
    drafter.train(was_training)
    return records


def summarize(records: list[dict], block_size: int, budgets: list[int], prefix: str = "eval") -> dict:
    """Micro (per block) and macro (per prompt) means, the tau histogram and a per-prompt table."""
    per_prompt: dict[str, list[dict]] = {}
    for r in records:
        per_prompt.setdefault(r["prompt_id"], []).append(r)

    def block_stats(r: dict) -> dict:
        correct = [d == t for d, t in zip(r["draft_tokens"], r["target_tokens"])]
        out = {f"acc@{k}": float(c) for k, c in enumerate(correct, 1)}
        out["streak"] = float(r["streak"])
        out["tau"] = r["streak"] + 1.0
        for n in budgets:
            out[f"ddtree@{n}"] = float(ddtree_tau(r["topk_ids"], r["topk_logprobs"], r["target_tokens"], n))
        return out

    stats = [block_stats(r) for r in records]
    keys = list(stats[0]) if stats else []
    mean = lambda rows, k: sum(s[k] for s in rows) / max(1, len(rows))  # noqa: E731
    table, start = {}, 0
    for pid, rs in per_prompt.items():
        rows = stats[start: start + len(rs)]
        start += len(rs)
        table[pid] = {"blocks": len(rs), **{k: mean(rows, k) for k in keys}}
    summary = {f"{prefix}/{k}": mean(stats, k) for k in keys}
    summary.update({f"{prefix}/{k}_macro": sum(t[k] for t in table.values()) / max(1, len(table)) for k in keys})
    summary[f"{prefix}/blocks"] = len(records)
    summary[f"{prefix}/prompts"] = len(table)
    return {"metrics": summary, "tau_histogram": tau_histogram([s["tau"] for s in stats], block_size),
            "per_prompt": table, "block_size": block_size, "ddtree_budgets": list(budgets)}


def write_outputs(out_dir: Path, records: list[dict], summary: dict, extra: dict | None = None) -> None:
    """summary.json + blocks.jsonl into out_dir; an earlier evaluation there is kept under a dated name."""
    if out_dir.exists():
        import time

        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(out_dir.stat().st_mtime))
        keep, n = out_dir.with_name(f"{out_dir.name}.{stamp}"), 1
        while keep.exists():
            n += 1
            keep = out_dir.with_name(f"{out_dir.name}.{stamp}-{n}")
        out_dir.rename(keep)
    out_dir.mkdir(parents=True)
    with (out_dir / "blocks.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out_dir / "summary.json").write_text(json.dumps({**summary, **(extra or {})}, indent=1, sort_keys=True))


def evaluate_in_run(job: JobConfig, drafter, target, eval_set, run_dir: Path, step: int, logger, backend: str) -> dict:
    """Teacher-forced eval during training, into eval/step-XXXXXX/ and the training run's W&B run.
    Returns the whole summary (metrics, histogram, per-prompt table)."""
    from dflash.plots import save_plots
    from dflash.reporting import log_eval

    records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval, backend)
    summary = summarize(records, drafter.block_size, job.eval.ddtree_budgets)
    out_dir = run_dir / "eval" / f"step-{step:06d}"
    write_outputs(out_dir, records, summary, {"step": step, "mode": "teacher_forced"})
    images = save_plots(out_dir, {f"step {step}": summary}) if job.eval.plots else {}
    log_eval(logger, summary, step, images)
    return summary


def find_run(job: JobConfig, checkpoint: str) -> Path | None:
    """The run a checkpoint belongs to: run.name, the run holding a checkpoint path, or the newest run."""
    from dflash.runlog import latest_run

    root = Path(job.run.root)
    if job.run.name:
        run_dir = root / job.run.name
        if not run_dir.is_dir():
            names = sorted(p.name for p in root.iterdir() if (p / "run.json").exists()) if root.is_dir() else []
            raise FileNotFoundError(f"no run {job.run.name!r} under {root}; runs there: {', '.join(names) or 'none'}")
        return run_dir
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        owner = path.resolve().parent.parent
        return owner if (owner / "run.json").exists() else None
    return latest_run(root)


def _check_trained_on(job: JobConfig, path: Path, label: str, features: dict, what: str, extra: dict) -> None:
    """The provenance guard: `features` must match what the drafter at `path` was trained on."""
    from dflash import checkpoint as ckpt
    from dflash.provenance import check_provenance

    manifest = ckpt.training_manifest(path)
    if manifest is None:
        log.warning("drafter %s carries no training manifest (not trained by dflash): provenance of its features "
                    "cannot be checked", path)
        return
    extra.setdefault("provenance_allowed", {})[label] = check_provenance(
        manifest, features, job.provenance.allow_mismatch, expected_name=f"drafter {label}'s training features",
        actual_name=what)


def evaluate(job: JobConfig) -> dict:
    """evaluate.py: metrics of a checkpoint (and eval.compare drafters) on the held-out set."""
    from dflash import checkpoint as ckpt
    from dflash.builders import check_fits, load_drafter
    from dflash.dist import current
    from dflash.plots import save_plots
    from dflash.reporting import log_eval, print_summary
    from dflash.runlog import RunLogger, setup_logging
    from dflash.target import load_target

    setup_logging()
    run_dir = find_run(job, job.checkpoint)
    path = ckpt.resolve_checkpoint(run_dir, job.checkpoint)
    ckpt.check_complete(path)
    step = ckpt.checkpoint_step(path)
    trained_on = ckpt.training_manifest(path)
    target = load_target(job.target)
    drafters = {f"step{step}" if step is not None else path.name: (path, load_drafter(str(path)).float())}
    for ref in job.eval.compare:
        drafters[Path(ref).name] = (Path(ref), load_drafter(ref).float())
    for label, (p, d) in drafters.items():
        check_fits(d, target, source=f"drafter {p}")
        d.to(target.device)
    dist = current()
    summaries, extra = {}, {"checkpoint": str(path), "step": step, "mode": job.eval.mode}
    for label, (p, drafter) in drafters.items():
        if job.eval.mode == "live":
            from dflash.extraction import target_signature
            from dflash.live import live_eval
            from dflash.target import kernel_backend

            live_features = {**target_signature(target), "layer_ids": drafter.target_layer_ids,
                             "kernel_backend": kernel_backend(target.kernels)}
            _check_trained_on(job, p, label, live_features, "the live target's features", extra)
            records, summary = live_eval(job, drafter, target)
        else:
            ensure_eval_cache(job, target, drafter.target_layer_ids, dist)
            eval_set = load_eval_set(job, target, drafter.target_layer_ids)
            _check_trained_on(job, p, label, eval_set.manifest, "the held-out features", extra)
            records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval)
            summary = summarize(records, drafter.block_size, job.eval.ddtree_budgets)
        summaries[label] = summary
        if label == next(iter(drafters)):
            name = (f"step-{step:06d}" if step is not None else p.name) + ("-live" if job.eval.mode == "live" else "")
            main_out = out = (run_dir or Path(job.run.root)) / "eval" / name
            write_outputs(out, records, summary, extra)
        else:
            write_outputs(main_out / "compare" / label, records, summary, extra)
    images = save_plots(main_out, summaries) if job.eval.plots else {}
    print_summary(summaries, job.eval.mode)
    if run_dir is not None and step is not None and trained_on is not None:
        logger = RunLogger(run_dir, job.logger, job, job_type="eval")
        log_eval(logger, next(iter(summaries.values())), step, images)
        logger.finish()
    log.info("evaluation written to %s", main_out)
    return next(iter(summaries.values()))["metrics"]
