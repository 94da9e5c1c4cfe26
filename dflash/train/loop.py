"""train(job): the DFlash training loop (accelerate: one process to many nodes).

Read `train()` top to bottom: set-up, then the step loop with its helpers `train_step` (in
dflash.train.step, with what a step costs the host), `log_window`, `evaluate` and `save`. Offline
mode reads the feature cache (extracted first if missing); online mode runs the frozen target
in-process on every batch through the same feature function. Either way the drafter borrows the
target's frozen embed_tokens and lm_head, and the objective is DESIGN §2's.
"""

from __future__ import annotations

import logging
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.config import JobConfig, TrainConfig
from dflash.data.mixture import shares
from dflash.dist import Dist, current
from dflash.drafter import metrics
from dflash.drafter.attention import flex_compile_count
from dflash.drafter.build import build_drafter, check_conv_kernel, load_trained, use_conv_kernel
from dflash.drafter.recompute import compile_layers, use_checkpointing
from dflash.drafter.selector_loss import CodebookSpan, served_selector
from dflash.errors import CheckpointError, ConfigError, TrainingError
from dflash.evaluate import heldout
from dflash.evaluate.runner import evaluate_in_run
from dflash.io import write_text
from dflash.layout import RunLayout
from dflash.provenance import check_provenance
from dflash.report.summary import print_summary
from dflash.tracking import RunLogger, config_dict, default_run_name, record_run, setup_logging
from dflash.train import checkpoints as ckpt
from dflash.train.accel import full_drafter, full_state_dict, is_fsdp, make_accelerator
from dflash.train.batches import MicroBatches, Schedule
from dflash.train.fit import resolve_checkpointing, step_plan
from dflash.train.optim import build_optimizer, build_scheduler, check_optimizer
from dflash.train.sources import keep_heads_only, training_source, training_target
from dflash.train.step import train_step, window_totals

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop carries between steps (step and best_tau are restored from a checkpoint)."""

    step: int = 0
    total_steps: int = 0
    """The run's optimizer steps (the selector weight's schedule reads them; 0 = no schedule)."""
    best_tau: float | None = None
    window: dict = field(default_factory=dict)
    """Sums since the last log line: loss, slot counts, tokens, anchors, weight, grad norm (device tensors
    but the token and anchor counts; read back by log_window only)."""
    window_start: float = field(default_factory=time.time)


@dataclass
class Model:
    """The drafter and what updates it. `model` is what the forward calls (DDP/FSDP/compiled wrapper; under
    FSDP `drafter` is the same module, its parameters sharded)."""

    drafter: torch.nn.Module
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    conv_kernel: str = "torch"
    """What DFlash 2's convolutions run through (train.conv_kernel resolved: torch or triton)."""
    after_step: object = None
    """Called after every optimizer step: the selector's CodebookSpan (loss.selector.span not free), or None."""


def train(job: JobConfig) -> Path:
    """Train a drafter as configured; returns the run folder."""
    if job.checkpoint != "latest":
        raise ConfigError("checkpoint= selects what evaluate.py evaluates; to continue training use "
                          "train.resume=latest|best|step<N>|<path>")
    acc = make_accelerator(job.train)
    backend = attention_backend(job.train, acc.device)  # before any work: flex cannot train on a CPU
    check_conv_kernel(job.drafter, job.train.conv_kernel, acc.device)  # nor DFlash 2's Triton convolution
    check_optimizer(job.optim, fsdp=is_fsdp(acc))
    if job.drafter.kind == "dflash2" and job.loss.selector.span != "free" and is_fsdp(acc):
        raise ConfigError(f"loss.selector.span={job.loss.selector.span} projects whole codebooks after each step, "
                          f"which FSDP shards: train with DDP (train.distributed=ddp) or loss.selector.span=free")
    dist = current()  # the Accelerator's processes, with the store that long waits go through
    setup_logging(main=acc.is_main_process)
    run = open_run(job, acc)
    setup_logging(run.log if acc.is_main_process else None, acc.is_main_process)
    resume_from = ckpt.resolve_checkpoint(run, job.train.resume) if job.train.resume else None
    resumed = ckpt.load_train_state(resume_from) if resume_from else None
    if resumed:  # before any data work: a checkpoint this run cannot continue stops here
        ckpt.check_resumable(resume_from, resumed["state"], "fsdp" if is_fsdp(acc) else "ddp", acc.num_processes)

    # the modes the job leaves to the device, decided once here and passed down (the job is never written)
    plan = step_plan(job, acc.device)
    checkpointing = resolve_checkpointing(job, acc.device, plan)
    if acc.is_main_process:
        record_run(run, gradient_checkpointing=checkpointing)

    # data: the training source and the held-out set (the full target only while extracting)
    target, layer_ids = training_target(job, acc.device, checkpointing, plan)
    source, manifest = training_source(job, target, layer_ids, dist)
    heldout.prepare(job, target, layer_ids, dist)
    heldout_set = heldout.load(job, target, layer_ids) if acc.is_main_process else None
    if heldout_set is not None:  # heads-only training cannot see the kernels: compare what made the two sets
        check_provenance(manifest, heldout_set.manifest, job.provenance.allow_mismatch,
                         expected_name="the training features", actual_name=f"the held-out features in "
                         f"{heldout_set.root}", fields=("kernel_backend",))
    if job.train.mode == "offline":
        keep_heads_only(target)
    dist.wait_long("data")  # each process took its own time (loading, hashing, extracting); DDP set-up is a collective

    # the drafter, fresh or resumed
    if resumed and resumed["manifest"] is not None:
        check_provenance(resumed["manifest"], manifest, job.provenance.allow_mismatch,
                         expected_name=f"checkpoint {resume_from.name}", actual_name="the training features")
    torch.manual_seed(job.train.seed)  # here, so the init does not depend on what data preparation drew
    random.seed(job.train.seed)
    # resumed: the float32 weights (read with the training state), not the servable copy (bf16, its selector shrunk)
    drafter = load_trained(str(resume_from), resumed["weights"]) if resume_from else build_drafter(
        job.drafter, job.layers, target, successor_init=job.loss.selector.init)
    if drafter.target_layer_ids != layer_ids:
        raise ConfigError(f"the drafter reads layers {drafter.target_layer_ids} but the config gives {layer_ids}")
    schedule = Schedule(len(source), job.train.batch_size, acc.num_processes, job.train.grad_accum, job.train.seed,
                        shares(job.data, [source.id_of(i) for i in range(len(source))]))
    total = job.train.max_steps or job.train.epochs * schedule.steps_per_epoch
    state = TrainState(total_steps=total)
    m = prepare_model(job, acc, drafter, total, resumed, state, checkpointing)
    if drafter.kind == "dflash2" and job.loss.selector.span != "free":
        m.after_step = CodebookSpan(drafter.candidate_selector, target.embed_tokens.weight,
                                    target.lm_head.weight if job.loss.selector.span == "embedding" else None)
    if drafter.kind == "dflash2" and acc.is_main_process:  # which convolution this process trained with
        record_run(run, conv_kernel=m.conv_kernel)

    gamma = job.loss.gamma_for(drafter.block_size)
    data = MicroBatches(source, schedule, acc.process_index, state.step, total, job.train.num_anchors,
                        drafter.block_size, drafter.mask_token_id, gamma,
                        topk=job.loss.soft_labels or job.loss.selector.labels == "target")
    # pinned (Batch.pin_memory) on CUDA, so train_step's non_blocking copies do not wait for the device
    batches = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=job.train.num_workers,
                                               pin_memory=acc.device.type == "cuda"))
    logger = RunLogger(run, job.logger, job, main=acc.is_main_process, job_type="train")
    logger.summary({"train/total_steps": total, "train/num_sequences": len(source)})
    evals: dict[str, dict] = {}
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=state.step, desc="train", unit="step",
                   disable=not acc.is_main_process or None)
        last_line = time.time()
        if job.eval.at_start and state.step == 0:
            evals["untrained (step 0)"] = evaluate(job, acc, m, target, heldout_set, run, logger, 0, backend)
        state.window_start = time.time()
        while state.step < total:
            micro = [next(batches, None) for _ in range(job.train.grad_accum)]
            if micro[-1] is None:
                raise TrainingError(f"the data loader ended at step {state.step} of {total}")
            train_step(job, acc, m, target, micro, state, gamma, backend, run)
            state.step += 1
            bar.update(1)
            step, last = state.step, state.step == total
            if step % job.train.log_every == 0 or last:
                row = log_window(acc, logger, m, state, schedule.steps_per_epoch)
                bar.set_postfix(loss=f"{row['train/loss']:.4f}", tau=f"{row['train/tau']:.2f}")
                if bar.disable and time.time() - last_line > 30:  # no live bar (not a terminal): a line
                    last_line = time.time()
                    log.info("step %d/%d  loss %.4f  train tau %.2f  lr %.2e  %.0f tokens/s", step, total,
                             row["train/loss"], row["train/tau"], row["train/lr"], row["train/tokens_per_s"])
            eval_now = last or bool(job.eval.every and step % job.eval.every == 0)
            if eval_now or step % job.train.save_every == 0:
                if state.window:
                    log_window(acc, logger, m, state, schedule.steps_per_epoch)
                summary = evaluate(job, acc, m, target, heldout_set, run, logger, step, backend) \
                    if eval_now else None
                if summary is not None:
                    evals[f"step {step}"] = summary
                save(job.train, job.loss.selector.shrink, acc, m, run, state, manifest, total, summary, logger)
        bar.close()
    finally:
        logger.finish()
    if acc.is_main_process and evals:

        print(f"\nheld-out evaluation ({job.eval.prompts}, teacher-forced):")
        print_summary(evals)
        print(f"run folder: {run.path}")
    return run.path


def attention_backend(train: TrainConfig, device: torch.device) -> str:
    if train.attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if train.attention == "flex" and device.type != "cuda":
        raise ConfigError(f"train.attention=flex needs a CUDA device: torch {torch.__version__} has no flex "
                          f"attention backward on {device.type}; use train.attention=sdpa (or auto, which picks "
                          f"sdpa here and flex on CUDA)")
    return train.attention


def open_run(job: JobConfig, acc) -> RunLayout:
    """The run folder (created by the main process; its name broadcast to all)."""
    from accelerate.utils import broadcast_object_list
    from omegaconf import OmegaConf

    name = [job.run.name or (default_run_name(job.target) if acc.is_main_process else None)]
    if job.train.resume and Path(job.train.resume).expanduser().is_dir():
        name = [RunLayout.of_checkpoint(Path(job.train.resume)).name]
    if acc.num_processes > 1:
        broadcast_object_list(name)
    run = RunLayout(Path(job.run.root) / name[0])
    if acc.is_main_process:
        if run.list_checkpoints() and not job.train.resume:
            raise ConfigError(f"run {run.path} already has checkpoints; resume it with train.resume=latest, or "
                              f"choose another run.name (nothing there was changed)")
        run.path.mkdir(parents=True, exist_ok=True)
        write_text(run.config, OmegaConf.to_yaml(OmegaConf.create(config_dict(job))))
        record_run(run)
    acc.wait_for_everyone()
    return run


def prepare_model(job: JobConfig, acc, drafter, total: int, resumed: dict | None, state: TrainState,
                  checkpointing: str) -> Model:
    """Optimizer and schedule, checkpointing (`checkpointing`: off, selective or full, as resolved), compile,
    DFlash 2's convolution kernel, accelerate wrappers; when resuming, the optimizer, schedule and every process's RNG
    come back through accelerate's load_state (after prepare: under FSDP the optimizer state is loaded into the
    shards)."""
    optimizer = build_optimizer(drafter, job.optim, codebook_decay=job.loss.selector.decay)
    scheduler = build_scheduler(optimizer, total, job.optim)
    format1 = bool(resumed) and ckpt.train_state_format(resumed["state"]) == 1
    if format1:  # the main process's state, as written before save_state: the same on every DDP process
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
    if resumed:
        state.step, state.best_tau = resumed["state"]["step"], resumed["state"].get("best_tau")
    use_checkpointing(drafter, checkpointing)
    conv_kernel = use_conv_kernel(drafter, job.train.conv_kernel, acc.device, compiled=job.train.compile != "off")
    model = torch.compile(drafter) if job.train.compile == "model" else drafter
    if job.train.compile == "layers":
        compile_layers(drafter)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    # train_state/weights_fp32.safetensors is the float32 copy of the weights (loaded before prepare), so
    # under DDP save_state writes no second one and load_state reads none; FSDP's gathered copy stays (its
    # load_state puts the weights into the shards)
    acc.register_save_state_pre_hook(lambda models, weights, folder: weights.clear())
    acc.register_load_state_pre_hook(lambda models, folder: models.clear())
    if format1:
        _restore_rng(resumed["rng"])
    elif resumed:
        try:
            acc.load_state(str(resumed["train_state"]))
        except Exception as e:
            raise CheckpointError(f"cannot read the training state in {resumed['train_state']} ({e}); it is "
                                  f"corrupt. Resume from another checkpoint") from e
    return Model(drafter, model, optimizer, scheduler, conv_kernel)


def log_window(acc, logger: RunLogger, m: Model, state: TrainState, steps_per_epoch: int) -> dict:
    """Reduce the window's sums over processes (one collective, one read-back) and log train/* metrics;
    returns them."""
    w = window_totals(acc, state.window)
    elapsed = max(time.time() - state.window_start, 1e-9)
    counts = {k: v for k, v in w["counts"].items() if not k.startswith(("unary_", "oracle_"))}
    out = {"train/loss": w["loss_sum"] / max(w["weight"], 1e-12),
           **metrics.finalize(counts, "train"),
           "train/lr": m.scheduler.get_last_lr()[0], "train/grad_norm": w["grad_norm"],
           "train/tokens_per_s": w["tokens"] / elapsed, "train/anchors_per_s": w["anchors"] / elapsed,
           "train/peak_memory_gb": peak_memory_bytes(acc.device) / 2**30,
           "train/epoch": state.step / steps_per_epoch}
    if "selector_sum" in w:  # DFlash 2: train/tau and acc@k are the selector's, as served (among the unary top-K);
        # the argmax path's and the oracle's (gold among the unary top-K: recall per slot, its streak the ceiling)
        out["train/selector_loss"] = w["selector_sum"] / max(w["selector_weight"], 1e-12)
        for part in ("unary", "oracle"):
            out.update(metrics.finalize({k.removeprefix(f"{part}_"): v for k, v in w["counts"].items()
                                         if k.startswith(f"{part}_")}, f"train/{part}"))
        oracle = w["counts"]
        out["train/topk_recall"] = float(oracle["oracle_correct"].sum() / oracle["oracle_valid"].sum().clamp_min(1))
    if flex_compile_count():  # bounded by the length buckets (see dflash.tiling.flex_padded_shape)
        out["train/flex_compiles"] = flex_compile_count()
    logger.log(out, state.step)
    state.window = {}
    state.window_start = time.time()
    return out


def evaluate(job: JobConfig, acc, m: Model, target, heldout_set, run: RunLayout, logger: RunLogger, step: int,
             backend: str) -> dict | None:
    """Held-out teacher-forced eval of the current drafter, on full parameters, on the main process (the others
    wait); the summary there, None elsewhere."""
    drafter = full_drafter(acc, m)
    summary = None
    if acc.is_main_process and heldout_set is not None:
        with served_selector(drafter, job.loss.selector.shrink):  # the drafter as its checkpoint will serve it
            summary = evaluate_in_run(job, drafter, target, heldout_set, run, step, logger, backend)
    del drafter
    current().wait_long("eval")  # the others wait for as long as the held-out set takes, not a collective's timeout
    return summary


def save(cfg: TrainConfig, selector_shrink: float, acc, m: Model, run: RunLayout, state: TrainState, manifest: dict,
         total: int, summary: dict | None, logger: RunLogger) -> None:
    """Checkpoint `state.step` (cfg: the train group; selector_shrink: loss.selector.shrink, what a DFlash 2
    checkpoint serves). Every process takes part: gathering the weights (FSDP) and writing its share of
    accelerate's save_state (optimizer, scheduler, its RNG) into the temp folder; the main process writes the
    rest, renames atomically, and keeps best.json and keep_last."""
    step = state.step
    weights = full_state_dict(acc, m)
    loop_state = None
    if acc.is_main_process:
        tau = summary["metrics"]["eval/tau"] if summary else None
        if tau is not None and (state.best_tau is None or tau > state.best_tau):
            state.best_tau = tau
        loop_state = {"step": step, "total_steps": total, "best_tau": state.best_tau, "world_size": acc.num_processes,
                      "distributed": "fsdp" if is_fsdp(acc) else "ddp", "seed": cfg.seed,
                      "global_batch": cfg.batch_size * acc.num_processes * cfg.grad_accum}
    dist = Dist(acc.process_index, acc.num_processes, acc.wait_for_everyone)
    weights = {k: v.cpu() for k, v in weights.items()} if acc.is_main_process else {}
    path = ckpt.save_checkpoint(run, step, m.drafter, weights, loop_state, manifest, cfg.save_dtype,
                                save_state=lambda folder: acc.save_state(str(folder)), dist=dist,
                                selector_shrink=selector_shrink)
    if acc.is_main_process:
        best = tau is not None and tau == state.best_tau
        if best:
            ckpt.mark_best(run, step, tau)
        ckpt.prune(run, cfg.keep_last)
        logger.log_checkpoint(path, step, ["latest", f"step-{step}"] + (["best"] if best else []))
        log.info("step %d: checkpoint %s%s", step, path, f", held-out tau {tau:.3f}" if tau is not None else "")
    acc.wait_for_everyone()


def _restore_rng(rng: dict) -> None:
    """The RNG of a format-1 checkpoint (the main process's, restored on every process, as it was then)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if torch.cuda.is_available() and rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
