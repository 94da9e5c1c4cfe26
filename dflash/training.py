"""train(job): the DFlash training loop (accelerate: one process to many nodes).

Offline mode reads the feature cache (extracted first if missing); online mode runs the frozen
target in-process on every batch through the same feature function. Either way the drafter
borrows the target's frozen embed_tokens and lm_head, and the objective is DESIGN §2's.
"""

from __future__ import annotations

import gc
import logging
import random
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash import checkpoint as ckpt
from dflash import metrics
from dflash.blocks import draft_packed
from dflash.builders import build_drafter, load_drafter
from dflash.cache import FeatureCache
from dflash.config import ConfigError, JobConfig
from dflash.dist import Dist
from dflash.features import target_forward
from dflash.loss import block_loss
from dflash.optim import build_optimizer, build_scheduler
from dflash.provenance import check_provenance
from dflash.runlog import RunLogger, config_dict, default_run_name, git_commit, setup_logging, write_json
from dflash.target import load_target, resolve_layer_ids
from dflash.trainset import CachedSource, MicroBatches, Schedule, SequenceSource, add_noise

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue; the message names the step, the batch and what to do."""


@dataclass
class TrainState:
    """What the loop carries between steps (and what a checkpoint restores)."""

    step: int = 0
    best_tau: float | None = None
    window: dict = field(default_factory=dict)


def make_accelerator(job: JobConfig):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    cuda = torch.cuda.is_available()
    precision = job.train.mixed_precision
    precision = ("bf16" if cuda else "no") if precision == "auto" else precision
    plugin = FullyShardedDataParallelPlugin() if job.train.distributed == "fsdp" else None
    return Accelerator(mixed_precision=precision, fsdp_plugin=plugin, cpu=not cuda)


def attention_backend(job: JobConfig, device: torch.device) -> str:
    if job.train.attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return job.train.attention


def open_run(job: JobConfig, accelerator) -> Path:
    """The run folder (created by the main process; its name broadcast to all)."""
    from accelerate.utils import broadcast_object_list

    name = [job.run.name or (default_run_name(job) if accelerator.is_main_process else None)]
    if job.train.resume and Path(job.train.resume).expanduser().is_dir():
        name = [Path(job.train.resume).expanduser().resolve().parent.parent.name]
    if accelerator.num_processes > 1:
        broadcast_object_list(name)
    run_dir = Path(job.run.root) / name[0]
    if accelerator.is_main_process:
        if (run_dir / "checkpoints").is_dir() and ckpt.list_checkpoints(run_dir) and not job.train.resume:
            raise ConfigError(f"run {run_dir} already has checkpoints; resume it with train.resume=latest, or "
                              f"choose another run.name (nothing there was changed)")
        run_dir.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config_dict(job))))
        if not (run_dir / "run.json").exists():
            write_json(run_dir / "run.json", {"name": run_dir.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                              "git_commit": git_commit()})
    accelerator.wait_for_everyone()
    return run_dir


def prepare_data(job: JobConfig, accelerator, dist: Dist):
    """Target, training source, eval set and the manifest of the training features."""
    from dflash import evaluation, extraction

    offline = job.train.mode == "offline"
    target = load_target(job.target, accelerator.device, heads_only=offline)
    layer_ids = resolve_layer_ids(job.layers, target.num_layers)
    cache_missing = offline and not extraction.cache_is_complete(job.features)
    need_full = not offline or cache_missing or not evaluation.eval_cache_ready(job, target, layer_ids)
    if need_full and target.model is None:
        target = load_target(job.target, accelerator.device)
    if cache_missing:
        log.info("no complete feature cache at %s: extracting it first", job.features.dir)
        extraction.extract_with(job, target, dist)
    if need_full:
        evaluation.ensure_eval_cache(job, target, layer_ids, dist)
    eval_set = evaluation.load_eval_set(job, target, layer_ids) if dist.is_main else None
    if offline:
        cache = FeatureCache(job.features.dir, dtype=torch.float32)
        manifest = cache.manifest
        source = CachedSource(cache)
        if manifest["layer_ids"] != layer_ids:
            raise ConfigError(f"features.dir={job.features.dir} holds layers {manifest['layer_ids']} but the drafter "
                              f"reads {layer_ids}; set features.dir to a new directory or change layers")
        # a cache of another target, tokenizer or dtype is refused (kernels are checked where the
        # model runs: at evaluation, and against the checkpoint on resume)
        check_provenance({**extraction.target_signature(target), "layer_ids": layer_ids}, manifest,
                         job.provenance.allow_mismatch, expected_name=f"target {job.target.name}",
                         actual_name=f"the feature cache {job.features.dir}",
                         fields=("target", "tokenizer", "dtype", "layer_ids"))
        if need_full:  # the full target was only needed for extraction: keep just its heads
            target.model = target.layers = target.final_norm = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    else:
        store = extraction.default_completions_path(job.data, job.features)
        prepared = extraction.prepare_sequences(job.data, target, store, dist)
        manifest = extraction.features_manifest(target, layer_ids, "online", job.data.max_length, prepared.info,
                                                job.features.shard_sequences)
        source = SequenceSource(prepared.sequences)
    return target, layer_ids, source, manifest, eval_set


def train(job: JobConfig) -> Path:
    """Train a drafter as configured; returns the run folder."""
    if job.checkpoint != "latest":
        raise ConfigError("checkpoint= selects what evaluate.py evaluates; to continue training use "
                          "train.resume=latest|best|step<N>|<path>")
    accelerator = make_accelerator(job)
    dist = Dist(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone)
    setup_logging(main=accelerator.is_main_process)
    run_dir = open_run(job, accelerator)
    setup_logging(run_dir / "train.log" if accelerator.is_main_process else None, accelerator.is_main_process)
    target, layer_ids, source, manifest, eval_set = prepare_data(job, accelerator, dist)
    resume_from = ckpt.resolve_checkpoint(run_dir, job.train.resume) if job.train.resume else None
    resumed = ckpt.load_train_state(resume_from) if resume_from else None
    if resumed and resumed["manifest"] is not None:
        check_provenance(resumed["manifest"], manifest, job.provenance.allow_mismatch,
                         expected_name=f"checkpoint {resume_from.name}", actual_name="the training features")
    torch.manual_seed(job.train.seed)  # here, so the init does not depend on what data preparation drew
    random.seed(job.train.seed)
    drafter = load_drafter(str(resume_from)).float() if resume_from else build_drafter(job.drafter, job.layers, target)
    if drafter.target_layer_ids != layer_ids:
        raise ConfigError(f"the drafter reads layers {drafter.target_layer_ids} but the config gives {layer_ids}")

    schedule = Schedule(len(source), job.train.batch_size, accelerator.num_processes, job.train.grad_accum,
                        job.train.seed)
    total = job.train.max_steps or job.train.epochs * schedule.steps_per_epoch
    state = TrainState()
    optimizer = build_optimizer(drafter, job.optim)
    scheduler = build_scheduler(optimizer, total, job.optim)
    if resumed:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        state.step, state.best_tau = resumed["state"]["step"], resumed["state"].get("best_tau")
        if resumed["state"].get("world_size") != accelerator.num_processes:
            log.warning("resuming a %s-process run on %d processes: the data order changes from here on",
                        resumed["state"].get("world_size"), accelerator.num_processes)
    if job.train.gradient_checkpointing:
        drafter.gradient_checkpointing_enable()
    model = torch.compile(drafter) if job.train.compile else drafter
    model, optimizer = accelerator.prepare(model, optimizer)
    if resumed:
        _restore_rng(resumed["rng"])

    gamma = job.loss.gamma_for(drafter.block_size)
    data = MicroBatches(source, schedule, accelerator.process_index, state.step, total, job.train.num_anchors,
                        drafter.block_size, drafter.mask_token_id, gamma)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=job.train.num_workers,
                                         pin_memory=accelerator.device.type == "cuda")
    logger = RunLogger(run_dir, job.logger, job, main=accelerator.is_main_process, job_type="train")
    logger.summary({"train/total_steps": total, "train/num_sequences": len(source)})
    loop = Loop(job, accelerator, drafter, model, optimizer, scheduler, target, manifest, eval_set, logger, run_dir,
                attention_backend(job, accelerator.device), gamma, total, schedule.steps_per_epoch, state)
    try:
        loop.run(loader)
    finally:
        logger.finish()
    return run_dir


def _restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if torch.cuda.is_available() and rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Loop:
    """The step loop with its helpers: forward/backward, logging, checkpoints, held-out eval."""

    def __init__(self, job, accelerator, drafter, model, optimizer, scheduler, target, manifest, eval_set,
                 logger, run_dir, backend, gamma, total, steps_per_epoch, state):
        self.job, self.acc, self.drafter, self.model = job, accelerator, drafter, model
        self.optimizer, self.scheduler, self.target = optimizer, scheduler, target
        self.manifest, self.eval_set, self.logger, self.run_dir = manifest, eval_set, logger, run_dir
        self.backend, self.gamma, self.total, self.state = backend, gamma, total, state
        self.steps_per_epoch = steps_per_epoch
        self.evals: dict[str, dict] = {}
        self.n_layers = len(drafter.target_layer_ids)

    def run(self, loader) -> None:
        from tqdm import tqdm

        job, acc = self.job, self.acc
        bar = tqdm(total=self.total, initial=self.state.step, desc="train", unit="step",
                   disable=not acc.is_main_process or None)
        micro: list = []
        self.window_start = self.last_line = time.time()
        if job.eval.at_start and self.state.step == 0:
            self.evaluate()
        for batch in loader:
            micro.append(batch)
            if len(micro) < job.train.grad_accum:
                continue
            self.train_step(micro)
            micro = []
            self.state.step += 1
            bar.update(1)
            step = self.state.step
            if step % job.train.log_every == 0 or step == self.total:
                row = self.log_window()
                bar.set_postfix(loss=f"{row['train/loss']:.4f}", tau=f"{row['train/tau']:.2f}")
                if bar.disable and time.time() - self.last_line > 30:  # no live bar (not a terminal): a line
                    self.last_line = time.time()
                    log.info("step %d/%d  loss %.4f  train tau %.2f  lr %.2e  %.0f tokens/s", step, self.total,
                             row["train/loss"], row["train/tau"], row["train/lr"], row["train/tokens_per_s"])
            is_eval = job.eval.every and step % job.eval.every == 0 and step != self.total
            if step % job.train.save_every == 0 and step != self.total or is_eval:
                self.save(evaluate=bool(is_eval))
        bar.close()
        if self.state.step < self.total:
            raise TrainingError(f"the data loader ended at step {self.state.step} of {self.total}")
        self.save(evaluate=True)
        if acc.is_main_process and self.evals:
            from dflash.reporting import print_summary

            print(f"\nheld-out evaluation ({job.eval.prompts}, teacher-forced):")
            print_summary(self.evals)
            print(f"run folder: {self.run_dir}")

    def evaluate(self) -> dict | None:
        """Held-out eval of the current drafter (main process); others wait."""
        summary = None
        if self.acc.is_main_process and self.eval_set is not None:
            from dflash import evaluation

            step = self.state.step
            summary = evaluation.evaluate_in_run(self.job, self.drafter, self.target, self.eval_set, self.run_dir,
                                                 step, self.logger, self.backend)
            self.evals["untrained (step 0)" if step == 0 else f"step {step}"] = summary
        self.acc.wait_for_everyone()
        return summary

    def features(self, batch) -> torch.Tensor:
        if batch.features is not None:
            return batch.features.to(self.acc.device, non_blocking=True)
        mask = (torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]).long()
        out = target_forward(self.target, batch.input_ids.to(self.acc.device), self.drafter.target_layer_ids,
                             attention_mask=mask.to(self.acc.device) if bool((mask == 0).any()) else None)
        return out.features.float()

    def train_step(self, micro: list) -> None:
        acc, job = self.acc, self.job
        local_w = torch.tensor(sum(b.weight_sum for b in micro), dtype=torch.float64, device=acc.device)
        total_w = acc.reduce(local_w, reduction="sum").item() if acc.num_processes > 1 else local_w.item()
        scale = acc.num_processes / max(total_w, 1e-12)  # DDP averages gradients over processes
        window = self.state.window
        for i, batch in enumerate(micro):
            blocks = batch.blocks.to(acc.device)
            clean = self.features(batch)
            noised = add_noise(clean, job.noise, self.n_layers, job.train.seed, batch.epoch, batch.index)
            sync = i == len(micro) - 1
            with acc.no_sync(self.model) if not sync else nullcontext(), acc.autocast():
                hidden = draft_packed(self.drafter, self.target.embed_tokens, noised, blocks, self.backend,
                                      model=self.model)
                loss_sum, _, pred = block_loss(hidden, self.target.lm_head.weight, blocks.labels,
                                               blocks.label_mask, self.gamma, job.loss.chunk_logits)
            self._check_finite(loss_sum, batch)
            acc.backward(loss_sum * scale)
            window["loss_sum"] = window.get("loss_sum", 0.0) + loss_sum.item()
            window["counts"] = metrics.add(window.get("counts"), metrics.count(pred, blocks.labels, blocks.label_mask))
            window["tokens"] = window.get("tokens", 0) + int(batch.lengths.sum())
            window["anchors"] = window.get("anchors", 0) + int(blocks.valid.sum())
        window["weight"] = window.get("weight", 0.0) + total_w  # global: all processes and micro-batches
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), job.optim.grad_clip or float("inf"))
        if not torch.isfinite(torch.as_tensor(grad_norm)):
            raise TrainingError(self._bad(f"non-finite gradient norm ({grad_norm})", micro[-1]))
        window["grad_norm"] = float(grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _check_finite(self, loss_sum: torch.Tensor, batch) -> None:
        bad = torch.tensor(0.0 if torch.isfinite(loss_sum) else 1.0, device=self.acc.device)
        if self.acc.num_processes > 1:
            bad = self.acc.reduce(bad, reduction="sum")
        if bad.item():
            raise TrainingError(self._bad(f"non-finite loss ({loss_sum.item()})", batch))

    def _bad(self, what: str, batch) -> str:
        last = ckpt.list_checkpoints(self.run_dir)
        kept = f"the last good checkpoint {last[-1][1]} is untouched" if last else "no checkpoint was written yet"
        return (f"{what} at step {batch.step + 1} (epoch {batch.epoch}, micro-batch {batch.micro}, sequences "
                f"{batch.ids}); stopping, {kept}. Lower optim.lr, check those sequences' features, or resume "
                f"from the last checkpoint with train.resume=latest")

    def log_window(self) -> dict:
        """Reduce the window's sums over processes and log train/* metrics; returns them."""
        acc, w = self.acc, self.state.window
        sums = torch.tensor([w["loss_sum"], w["tokens"], w["anchors"]], dtype=torch.float64, device=acc.device)
        counts = {k: v.to(acc.device) for k, v in w["counts"].items()}
        if acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
            counts = {k: acc.reduce(v, reduction="sum") for k, v in counts.items()}
        elapsed = max(time.time() - self.window_start, 1e-9)
        out = {"train/loss": float(sums[0]) / max(w["weight"], 1e-12), **metrics.finalize(
            {k: v.cpu() for k, v in counts.items()}, "train"),
            "train/lr": self.scheduler.get_last_lr()[0], "train/grad_norm": w["grad_norm"],
            "train/tokens_per_s": float(sums[1]) / elapsed, "train/anchors_per_s": float(sums[2]) / elapsed,
            "train/peak_memory_gb": peak_memory_bytes(acc.device) / 2**30,
            "train/epoch": self.state.step / self.steps_per_epoch}
        self.logger.log(out, self.state.step)
        self.state.window = {}
        self.window_start = time.time()
        return out

    def save(self, evaluate: bool) -> None:
        """Checkpoint (main process writes, atomically), then the held-out eval if asked."""
        acc, step = self.acc, self.state.step
        if self.state.window:
            self.log_window()
        summary = self.evaluate() if evaluate else None
        # the z-lab names: without DDP/FSDP wrappers (get_state_dict) and torch.compile's prefix
        state_dict = {k.replace("_orig_mod.", ""): v for k, v in acc.get_state_dict(self.model).items()}
        if acc.is_main_process:
            tau = summary["metrics"]["eval/tau"] if summary else None
            if tau is not None and (self.state.best_tau is None or tau > self.state.best_tau):
                self.state.best_tau = tau
            state = {"step": step, "total_steps": self.total, "best_tau": self.state.best_tau,
                     "world_size": acc.num_processes, "seed": self.job.train.seed,
                     "global_batch": self.job.train.batch_size * acc.num_processes * self.job.train.grad_accum}
            path = ckpt.save_checkpoint(self.run_dir, step, self.drafter, {k: v.cpu() for k, v in state_dict.items()},
                                        self.optimizer.state_dict(), self.scheduler.state_dict(), _rng_state(),
                                        state, self.manifest)
            if tau is not None and tau == self.state.best_tau:
                ckpt.mark_best(self.run_dir, step, tau)
            ckpt.prune(self.run_dir, self.job.train.keep_last)
            log.info("step %d: checkpoint %s%s", step, path, f", held-out tau {tau:.3f}" if tau is not None else "")
        acc.wait_for_everyone()
