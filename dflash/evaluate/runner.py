"""Held-out evaluation of drafters: evaluate.py's job (`evaluate`) and the in-run evaluation that
training calls (`evaluate_in_run`).

Teacher-forced mode scores blocks on the held-out set's cached features (dflash.evaluate
.teacher_forced); live mode runs real speculative decoding with the target in the loop, checked
against plain decoding (dflash.evaluate.live). Either way the features are checked against what
each drafter was trained on (dflash.provenance), results go to runs/<name>/eval/<step>/ and eval/*
lands in the training run's W&B run at the checkpoint's training step. An evaluation at other settings than the run's
own lands beside its in-run one, tagged with what differs (dflash.evaluate.settings).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from dflash.config import EvalConfig, JobConfig, RunConfig, TargetConfig
from dflash.dist import current
from dflash.drafter.attention import flex_compile_count
from dflash.drafter.build import check_fits, load_drafter
from dflash.errors import CheckpointError, ConfigError, NotFoundError
from dflash.evaluate import heldout, suite_results, suites
from dflash.evaluate.live import live_eval
from dflash.evaluate.settings import evaluation_folder, figure_settings, job_config, reference_settings
from dflash.evaluate.slices import slicers
from dflash.evaluate.teacher_forced import summarize, teacher_forced, write_outputs
from dflash.io import write_json
from dflash.layout import RunLayout, step_name
from dflash.locate import check_complete, checkpoint_step, resolve_checkpoint, training_manifest
from dflash.provenance import check_trained_on, live_features
from dflash.report.plots import save_plots
from dflash.report.summary import (log_eval, log_suite, mean_metrics, print_suite, print_summary, reference_rows,
                                   train_gap)
from dflash.target.loading import load_target
from dflash.tracking import RunLogger, latest_run, setup_logging

log = logging.getLogger(__name__)


def evaluate_in_run(job: JobConfig, drafter, target, eval_set, run: RunLayout, step: int, logger,
                    backend: str) -> dict:
    """Teacher-forced eval during training, into eval/step-XXXXXX/ and the training run's W&B run.
    Returns the whole summary (metrics, histogram, per-prompt table)."""
    drafter = served_copy(drafter, getattr(torch, job.train.save_dtype), eval_dtype(job.eval, target))
    compiled = flex_compile_count()
    records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval, backend)
    summary = summarize(records, drafter.block_size, job.eval.ddtree_budgets, slices=slicers(job.data, job.eval))
    if backend == "flex":  # bounded by the length buckets: teacher_forced pads every forward to one block count
        summary["metrics"]["eval/flex_compiles"] = flex_compile_count() - compiled
        log.info("evaluation at step %d compiled %d flex graphs (%d in this process)", step,
                 flex_compile_count() - compiled, flex_compile_count())
    summary["metrics"].update(train_gap(run, step, summary["metrics"]))
    out_dir = run.eval_dir(step_name(step))
    summary["dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    # the settings the run's own evaluations are told by: evaluate.py writes here only at these (settings.py)
    write_outputs(out_dir, records, summary, {"step": step, "mode": "teacher_forced",
                                              "settings": figure_settings(job_config(job), in_run=True)})
    images = save_plots(out_dir, {f"step {step}": summary}) if job.eval.plots else {}
    log_eval(logger, summary, step, images)
    return summary


def served_copy(drafter, served: torch.dtype, dtype: torch.dtype):
    """The drafter as its checkpoint serves it, to evaluate in `dtype`: its weights rounded to `served` (what
    model.safetensors holds, train.save_dtype), as evaluate.py loads them; a copy where that changes a weight, so the
    training weights stay float32. Evaluating the float32 weights of a run on a float32 target read another drafter
    than the one served: 2.003 against evaluate.py's 2.005 for one DFlash 2 toy run. The copy runs its class's own
    forward: accelerate's train.mixed_precision wrapper (an instance `forward` under autocast, returning float32)
    stays on the training drafter, as evaluate.py runs none (DFlash 2's bf16 selector refused its float32 output)."""
    weights = next(drafter.parameters()).dtype
    wrapped = "forward" in vars(drafter)
    if weights == served == dtype and not wrapped:
        return drafter
    drafter = copy.deepcopy(drafter)
    if wrapped:
        del drafter.forward
        vars(drafter).pop("_original_forward", None)
    with torch.no_grad():
        for p in drafter.parameters():  # parameters only: buffers (rotary frequencies) are not saved, but rebuilt
            if p.is_floating_point():
                p.copy_(p.to(served))
    return drafter.to(dtype)


def eval_dtype(cfg: EvalConfig, target) -> torch.dtype:
    """eval.dtype as a torch dtype: auto = the target's, the dtype servers run the drafter in."""
    return target.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)


def find_run(cfg: RunConfig, checkpoint: str) -> RunLayout | None:
    """The run a checkpoint belongs to: run.name, the run holding a checkpoint path, or the newest run."""
    root = Path(cfg.root)
    if cfg.name:
        run = RunLayout(root / cfg.name)
        if not run.path.is_dir():
            names = sorted(p.name for p in root.iterdir() if RunLayout(p).is_run()) if root.is_dir() else []
            raise NotFoundError(f"no run {cfg.name!r} under {root}; runs there: {', '.join(names) or 'none'}")
        return run
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        owner = RunLayout.of_checkpoint(path)
        return owner if owner.is_run() else None
    if "/" in checkpoint or checkpoint.startswith((".", "~")):
        raise CheckpointError(f"checkpoint={checkpoint}: the path {path} does not exist; give a drafter folder, "
                              f"or latest, best, step<N> of a run (run.name=...)")
    return latest_run(root)


def evaluation_target(job: JobConfig, layer_sets: list[list[int]], jobs: list[JobConfig] | None = None):
    """The target as evaluation needs it. Teacher-forced evaluation from a complete held-out set uses
    only embed_tokens and lm_head: the decoder layers (54 GB for a 27B target) are never loaded, so a
    drafter is evaluated on a CPU box from features extracted on the GPU machine. Anything still to
    extract, and live decoding, needs the whole model. `jobs`: one per held-out set (a suite's benchmarks)."""
    if job.eval.mode == "teacher_forced":
        target = load_target(job.target, heads_only=True)
        if target.model is None and all(heldout.is_ready(j, target, ids) for j in jobs or [job] for ids in layer_sets):
            log.info("held-out features are complete: the target's heads are all that is loaded")
            return target
    return load_target(job.target)


def run_target(job: JobConfig, run: RunLayout | None) -> JobConfig:
    """The job with the target (and feature cache folder) the run was trained with, read from its config.yaml,
    where that is another target than the job's: `python evaluate.py checkpoint=latest` after
    `python train.py target=tiny_gemma` evaluates against tiny_gemma, not the default target."""
    if run is None:
        return job

    trained = run.trained_config()
    target = trained.get("target") or {}
    if not target or target.get("name") == job.target.name:
        return job
    log.info("target %s, as run %s was trained (its config.yaml); target=... or experiment=... chooses another",
             target["name"], run.name)
    features = replace(job.features, dir=trained.get("features", {}).get("dir", job.features.dir))
    return replace(job, target=TargetConfig(**target), features=features)


def evaluate(job: JobConfig, target_from_run: bool = False) -> dict:
    """evaluate.py: metrics of a checkpoint (and eval.compare drafters) on the held-out set, or on each
    benchmark of eval.suite.name (`evaluate_suite`). target_from_run: evaluate against the target the checkpoint's
    run was trained with (`run_target`; evaluate.py sets it when its command line names no target)."""
    setup_logging()
    run = find_run(job.run, job.checkpoint)
    if target_from_run:
        job = run_target(job, run)
    if job.eval.mode == "live" and job.target.tensor_parallel > 1:  # before anything loads
        raise ConfigError(f"eval=live decodes token by token on one process; target.tensor_parallel="
                          f"{job.target.tensor_parallel} extracts and trains only. Evaluate live with "
                          f"target.tensor_parallel=1 (target.device_map=auto places a target bigger than a GPU over "
                          f"several), or serve the drafter with vLLM")
    benches = suites.benchmark_jobs(job)  # a suite's files are found (or missing ones named) before anything loads
    path = resolve_checkpoint(run, job.checkpoint)
    check_complete(path)
    step = checkpoint_step(path)
    labelled = drafter_labels(path, f"step{step}" if step is not None else path.name, job.eval.compare)
    drafters = {label: (p, load_drafter(str(p)).float()) for label, p in labelled}
    target = evaluation_target(job, [d.target_layer_ids for _, d in drafters.values()], list(benches.values()))
    dtype = eval_dtype(job.eval, target)
    for label, (p, d) in drafters.items():
        check_fits(d, target, source=f"drafter {p}")
        d.to(target.device, dtype)
    dist = current(job.train.collective_timeout_minutes)
    settings = figure_settings(job_config(job))
    extra = {"checkpoint": str(path), "step": step, "mode": job.eval.mode, "dtype": str(dtype).removeprefix("torch."),
             "settings": settings}
    if job.eval.mode != "live" and job.eval.decode.temperature > 0:  # live's summary records its own (with verifier)
        extra["sampling"] = {k: getattr(job.eval.decode, k) for k in ("temperature", "top_p", "top_k",
                                                                        "selector_draw", "selector_truncation", "seed")}
    allowed = extra.setdefault("provenance_allowed", {})
    first = next(iter(drafters))
    base = (step_name(step) if step is not None else path.name) + ("-live" if job.eval.mode == "live" else "")
    # beside the run's own evaluation at other settings, never over it; the tag also namespaces the logged metrics
    own = reference_settings(run.trained_config()) if run is not None and run.config.exists() else None
    layout = RunLayout(run.path if run is not None else Path(job.run.root))
    main_out, tag = evaluation_folder(layout.eval_dir(base).parent, base, settings, own)
    outs = {label: main_out if label == first else main_out / "compare" / folder_name(label) for label in drafters}
    logged = run is not None and step is not None and training_manifest(path) is not None
    if job.eval.suite.name is not None:
        return evaluate_suite(job, benches, drafters, target, dist, extra, outs, run, step, logged, tag)
    summaries = {}
    for label, (p, drafter) in drafters.items():
        records, summary = score(job, label, p, drafter, target, dist, allowed)
        if label == first and step is not None and job.eval.mode != "live":
            summary["metrics"].update(train_gap(run, step, summary["metrics"]))
        summaries[label] = summary
        write_outputs(outs[label], records, summary, {**extra, "label": label, "drafter": str(p)})
    images = save_plots(main_out, summaries) if job.eval.plots else {}
    print_summary(summaries, job.eval.mode)
    if logged:
        logger = RunLogger(run, job.logger, job, job_type="eval")
        log_eval(logger, tagged(summaries[first], tag), step, images)
        logger.finish()
    log.info("evaluation written to %s", main_out)
    return summaries[first]["metrics"]


def drafter_labels(checkpoint: Path, own: str, compare: list[str]) -> list[tuple[str, Path]]:
    """(label, folder) of the checkpoint, then of each eval.compare entry: the names of the summary's rows, of the
    plots' curves and of each compared drafter's results (<eval dir>/compare/<folder_name(label)>/). The checkpoint
    keeps `own` (step768) and a compared drafter its folder's name; where labels clash, each clashing drafter
    takes one more folder of its path (run_a/export, run_b/export) until none do. `name=path` sets a compared
    drafter's label (a name has no `/`; an entry that is an existing folder is a path, `=` or not). Two entries
    that still share a label (the same folder twice, one name twice) are refused in one line, before anything
    loads. Labels are compared as folder names, so two never share a results folder."""
    # (how the user wrote it, folder, its labels shortest first)
    entries = [(f"checkpoint={checkpoint}", checkpoint, list(dict.fromkeys([own, *_suffixes(checkpoint)])))]
    for entry in compare:
        name, named, rest = entry.partition("=")
        if named and "/" not in name and not Path(entry).expanduser().is_dir():
            if name in ("", ".", "..") or not rest:
                raise ConfigError(f"eval.compare entry {entry!r}: expected name=path, a name (no '/') and a drafter "
                                  f"folder, e.g. \"run_a=/runs/a/export\"")
            entries.append((repr(entry), Path(rest).expanduser(), [name]))
        else:
            entries.append((repr(entry), Path(entry).expanduser(), _suffixes(Path(entry))))
    level = [0] * len(entries)  # which of its labels each entry has now
    while True:
        groups: dict[str, list[int]] = {}
        for i, (_, _, labels) in enumerate(entries):
            groups.setdefault(folder_name(labels[level[i]]), []).append(i)
        clashes = [g for g in groups.values() if len(g) > 1]
        if not clashes:
            return [(labels[level[i]], path) for i, (_, path, labels) in enumerate(entries)]
        for group in clashes:
            longer = [i for i in group if level[i] + 1 < len(entries[i][2])]
            if not longer:
                (a, path_a, labels_a), (b, path_b, labels_b) = entries[group[0]], entries[group[1]]
                la, lb = labels_a[level[group[0]]], labels_b[level[group[1]]]
                what = ("are the same folder" if _absolute(path_a) == _absolute(path_b) else
                        f"would both be labelled {la!r}" if la == lb else
                        f"would share a results folder ({la!r}, {lb!r})")
                raise ConfigError(f"eval.compare: {a} and {b} {what}; name the compared drafters apart as name=path, "
                                  f"e.g. eval.compare='[\"mine={path_b}\"]'")
            for i in longer:
                level[i] += 1


def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(path.expanduser()))  # no symlinks resolved: the path as the user sees it


def _suffixes(path: Path) -> list[str]:
    """A folder's labels, shortest first: /runs/a/export -> export, a/export, runs/a/export."""
    parts = _absolute(path).parts[1:]
    return ["/".join(parts[-n:]) for n in range(1, len(parts) + 1)] or [str(path)]


def folder_name(label: str) -> str:
    """A label as one folder's name: run_a/export -> run_a__export."""
    return label.replace("/", "__")


def tagged(summary: dict, tag: str) -> dict:
    """The summary as logged: its eval/* metrics under eval/<tag>/ at other settings than the run's (sampled, fewer
    prompts, ...: dflash.evaluate.settings; mode `other_settings`: no best-tau update, no per-position tables), so
    they stay off the run's eval/* curves; else as it is."""
    if not tag:
        return summary
    metrics = {k.replace("eval/", f"eval/{tag}/", 1): v for k, v in summary["metrics"].items()}
    return {**summary, "metrics": metrics, "mode": "other_settings"}


def score(job: JobConfig, label: str, path: Path, drafter, target, dist, allowed: dict) -> tuple[list[dict], dict]:
    """One drafter on job.eval.prompts: (records, summary), live or teacher-forced, after checking the features
    against what it was trained on (the fields allowed to differ go to allowed[label])."""
    trained_on = training_manifest(path)
    if job.eval.mode == "live":
        allowed[label] = check_trained_on(trained_on, live_features(target, drafter.target_layer_ids),
                                          job.provenance.allow_mismatch, label, "the live target's features", path)
        return live_eval(job.eval, job.data, drafter, target)
    heldout.prepare(job, target, drafter.target_layer_ids, dist)
    eval_set = heldout.load(job, target, drafter.target_layer_ids)
    allowed[label] = check_trained_on(trained_on, eval_set.manifest, job.provenance.allow_mismatch, label,
                                      "the held-out features", path)
    records = teacher_forced(drafter, target.embed_tokens, target.lm_head, eval_set, job.eval)
    return records, summarize(records, drafter.block_size, job.eval.ddtree_budgets, slices=slicers(job.data, job.eval))


def evaluate_suite(job: JobConfig, benches: dict[str, JobConfig], drafters: dict, target, dist, extra: dict,
                   outs: dict[str, Path], run: RunLayout | None, step: int | None, logged: bool, tag: str = "") -> dict:
    """Every drafter on every benchmark of eval.suite.name, each benchmark its own held-out set: per benchmark
    <out>/<bench>/ (summary.json, blocks.jsonl, plots), and <out>/summary.json with eval/<bench>/*, the mean over
    benchmarks (eval/<suite>/*), every prompt's tau, the references beside them and the train/eval gap; logged
    to the training run's W&B run when `logged`, under eval/<tag>/ when tagged (other settings than the run's)."""
    first = next(iter(drafters))
    own = {label: {**extra, "label": label, "drafter": str(p)} for label, (p, _) in drafters.items()}
    for label in drafters:  # opens the folders: an earlier evaluation there is kept under a dated name
        write_outputs(outs[label], [], {"suite": job.eval.suite.name, "complete": False}, own[label])
    per: dict[str, dict[str, dict]] = {label: {} for label in drafters}
    for bench, bjob in benches.items():
        log.info("benchmark %s: %s", bench, bjob.eval.prompts)
        for label, (p, drafter) in drafters.items():
            records, summary = score(bjob, label, p, drafter, target, dist, extra["provenance_allowed"])
            if summary.get("mode") == "live":
                summary["per_prompt"] = suite_results.live_per_prompt(records)
            write_outputs(outs[label] / bench, records, summary, {**own[label], "benchmark": bench,
                                                                  "prompts": bjob.eval.prompts})
            per[label][bench] = summary
        if job.eval.plots:
            save_plots(outs[first] / bench, {label: per[label][bench] for label in drafters})
    block_size = drafters[first][1].block_size
    refs = [{**r, "differs": suite_results.setting_differences(r, job, block_size)}
            for r in suite_results.load_references(job.eval.suite.references)]
    results = {}
    for label in drafters:
        result = suite_results.combine(job.eval.suite.name, per[label], job.eval.suite.protocol)
        result["references"] = reference_rows(refs, result["benchmarks"])
        if label == first and step is not None and job.eval.mode != "live":
            result["metrics"].update(train_gap(run, step, mean_metrics(result)))
        write_json(outs[label] / "summary.json", {**result, **own[label]})
        results[label] = result
    print_suite(results, job.eval.mode)
    if logged:
        logger = RunLogger(run, job.logger, job, job_type="eval")
        log_suite(logger, tagged(results[first], tag), step)
        logger.finish()
    log.info("evaluation written to %s", outs[first])
    return results[first]["metrics"]
