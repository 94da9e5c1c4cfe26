"""Held-out evaluation of drafters: evaluate.py's job (`evaluate`) and the in-run evaluation that
training calls (`evaluate_in_run`).

Teacher-forced mode scores blocks on the held-out set's cached features (dflash.evaluate
.teacher_forced); live mode runs real speculative decoding with the target in the loop, checked
against plain decoding (dflash.evaluate.live). Either way the features are checked against what
each drafter was trained on (dflash.provenance), results go to runs/<name>/eval/<step>/ and eval/*
lands in the training run's W&B run at the checkpoint's training step.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from dflash.config import JobConfig
from dflash.drafter.build import check_fits, load_drafter
from dflash.drafter.model import flex_compile_count
from dflash.errors import CheckpointError, NotFoundError
from dflash.evaluate import heldout
from dflash.evaluate.plots import save_plots
from dflash.evaluate.summary import log_eval, print_summary, train_gap
from dflash.evaluate.teacher_forced import summarize, teacher_forced, write_outputs
from dflash.layout import RunLayout, step_name
from dflash.locate import check_complete, checkpoint_step, resolve_checkpoint, training_manifest
from dflash.provenance import check_trained_on, live_features
from dflash.tracking import RunLogger, latest_run, setup_logging

log = logging.getLogger(__name__)


def evaluate_in_run(job: JobConfig, drafter, target, eval_set, run: RunLayout, step: int, logger,
                    backend: str) -> dict:
    """Teacher-forced eval during training, into eval/step-XXXXXX/ and the training run's W&B run.
    Returns the whole summary (metrics, histogram, per-prompt table)."""
    dtype = eval_dtype(job, target)
    if next(drafter.parameters()).dtype != dtype:  # a copy: the training weights stay float32
        drafter = copy.deepcopy(drafter).to(dtype)
    compiled = flex_compile_count()
    records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval, backend)
    summary = summarize(records, drafter.block_size, job.eval.ddtree_budgets)
    if backend == "flex":  # bounded by the length buckets: teacher_forced pads every forward to one block count
        summary["metrics"]["eval/flex_compiles"] = flex_compile_count() - compiled
        log.info("evaluation at step %d compiled %d flex graphs (%d in this process)", step,
                 flex_compile_count() - compiled, flex_compile_count())
    summary["metrics"].update(train_gap(run, step, summary["metrics"]))
    out_dir = run.eval_dir(step_name(step))
    summary["dtype"] = str(dtype).removeprefix("torch.")
    write_outputs(out_dir, records, summary, {"step": step, "mode": "teacher_forced"})
    images = save_plots(out_dir, {f"step {step}": summary}) if job.eval.plots else {}
    log_eval(logger, summary, step, images)
    return summary


def eval_dtype(job: JobConfig, target) -> torch.dtype:
    """eval.dtype as a torch dtype: auto = the target's, the dtype servers run the drafter in."""
    return target.dtype if job.eval.dtype == "auto" else getattr(torch, job.eval.dtype)


def find_run(job: JobConfig, checkpoint: str) -> RunLayout | None:
    """The run a checkpoint belongs to: run.name, the run holding a checkpoint path, or the newest run."""
    root = Path(job.run.root)
    if job.run.name:
        run = RunLayout(root / job.run.name)
        if not run.path.is_dir():
            names = sorted(p.name for p in root.iterdir() if RunLayout(p).is_run()) if root.is_dir() else []
            raise NotFoundError(f"no run {job.run.name!r} under {root}; runs there: {', '.join(names) or 'none'}")
        return run
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        owner = RunLayout.of_checkpoint(path)
        return owner if owner.is_run() else None
    if "/" in checkpoint or checkpoint.startswith((".", "~")):
        raise CheckpointError(f"checkpoint={checkpoint}: the path {path} does not exist; give a drafter folder, "
                              f"or latest, best, step<N> of a run (run.name=...)")
    return latest_run(root)


def evaluation_target(job: JobConfig, layer_sets: list[list[int]]):
    """The target as evaluation needs it. Teacher-forced evaluation from a complete held-out set uses
    only embed_tokens and lm_head: the decoder layers (54 GB for a 27B target) are never loaded, so a
    drafter is evaluated on a CPU box from features extracted on the GPU machine. Anything still to
    extract, and live decoding, needs the whole model."""
    from dflash.target.loading import load_target

    if job.eval.mode == "teacher_forced":
        target = load_target(job.target, heads_only=True)
        if target.model is None and all(heldout.is_ready(job, target, ids) for ids in layer_sets):
            log.info("held-out features are complete: the target's heads are all that is loaded")
            return target
    return load_target(job.target)


def evaluate(job: JobConfig) -> dict:
    """evaluate.py: metrics of a checkpoint (and eval.compare drafters) on the held-out set."""
    from dflash.dist import current

    setup_logging()
    run = find_run(job, job.checkpoint)
    path = resolve_checkpoint(run, job.checkpoint)
    check_complete(path)
    step = checkpoint_step(path)
    drafters = {f"step{step}" if step is not None else path.name: (path, load_drafter(str(path)).float())}
    for ref in job.eval.compare:
        drafters[Path(ref).name] = (Path(ref), load_drafter(ref).float())
    target = evaluation_target(job, [d.target_layer_ids for _, d in drafters.values()])
    dtype = eval_dtype(job, target)
    for label, (p, d) in drafters.items():
        check_fits(d, target, source=f"drafter {p}")
        d.to(target.device, dtype)
    dist = current(job.train.collective_timeout_minutes)
    summaries, extra = {}, {"checkpoint": str(path), "step": step, "mode": job.eval.mode,
                            "dtype": str(dtype).removeprefix("torch.")}
    allowed = extra.setdefault("provenance_allowed", {})
    for label, (p, drafter) in drafters.items():
        trained_on = training_manifest(p)
        if job.eval.mode == "live":
            from dflash.evaluate.live import live_eval

            allowed[label] = check_trained_on(trained_on, live_features(target, drafter.target_layer_ids),
                                              job.provenance.allow_mismatch, label, "the live target's features", p)
            records, summary = live_eval(job, drafter, target)
        else:
            heldout.prepare(job, target, drafter.target_layer_ids, dist)
            eval_set = heldout.load(job, target, drafter.target_layer_ids)
            allowed[label] = check_trained_on(trained_on, eval_set.manifest, job.provenance.allow_mismatch, label,
                                              "the held-out features", p)
            records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval)
            summary = summarize(records, drafter.block_size, job.eval.ddtree_budgets)
            if label == next(iter(drafters)) and step is not None:
                summary["metrics"].update(train_gap(run, step, summary["metrics"]))
        summaries[label] = summary
        if label == next(iter(drafters)):
            name = (step_name(step) if step is not None else p.name) + ("-live" if job.eval.mode == "live" else "")
            main_out = RunLayout(run.path if run is not None else Path(job.run.root)).eval_dir(name)
            write_outputs(main_out, records, summary, extra)
        else:
            write_outputs(main_out / "compare" / label, records, summary, extra)
    images = save_plots(main_out, summaries) if job.eval.plots else {}
    print_summary(summaries, job.eval.mode)
    if run is not None and step is not None and training_manifest(path) is not None:
        logger = RunLogger(run, job.logger, job, job_type="eval")
        log_eval(logger, next(iter(summaries.values())), step, images)
        logger.finish()
    log.info("evaluation written to %s", main_out)
    return next(iter(summaries.values()))["metrics"]
