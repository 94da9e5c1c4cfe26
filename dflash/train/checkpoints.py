"""Checkpoints: runs/<name>/checkpoints/step-XXXXXX/ = the drafter in z-lab layout
(config.json + model.safetensors, servable as is) + train_state/ (the loop state, the float32
weights, the manifest of the training features, and accelerate's save_state: optimizer, scheduler,
every process's RNG); see dflash.layout.

Writes are atomic: everything goes to a hidden temp directory, is fsynced, then renamed into
place, so a crash or a full disk never leaves a half-written checkpoint, and the previous one
stays valid. The newest `keep_last` are kept, plus the one named in best.json.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.dist import Dist
from dflash.drafter.build import save_drafter
from dflash.errors import CheckpointError, ConfigError
from dflash.io import write_json
from dflash.layout import CheckpointLayout, RunLayout
from dflash.locate import (  # noqa: F401  (re-exported: the loop reads checkpoints through this module)
    TRAIN_STATE_FORMAT, best_step, check_complete, checkpoint_step, parse_step, read_state, resolve_checkpoint,
    train_state_format, training_manifest)

log = logging.getLogger(__name__)

def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(run: RunLayout, step: int, drafter, state_dict: dict, state: dict | None,
                    manifest: dict | None, save_dtype: str = "bfloat16",
                    save_state: Callable[[Path], None] = lambda folder: None, dist: Dist | None = None,
                    selector_shrink: float | None = None) -> Path:
    """Write checkpoint `step` atomically; returns its directory. Every process calls this: each writes its
    part of train_state/ through `save_state(folder)` (accelerate's save_state: optimizer and scheduler from the
    main process, each process's RNG; under FSDP gathering the shards, a collective), then the main process
    writes the drafter (servable weights cast to `save_dtype`), the float32 weights, `state` and `manifest`
    (which only it needs to hold), fsyncs and renames. `selector_shrink` (DFlash 2, loss.selector.shrink): the
    servable predecessor codebook is the float32 one times it, and config.json records it (save_drafter). The
    other processes return before the rename. With several nodes the run folder must be one filesystem they share
    (each process writes its own RNG file)."""
    dist = dist or Dist()
    final = run.checkpoint(step).path
    tmp = CheckpointLayout(final.parent / f".tmp-{final.name}")  # one name: every process writes into it
    try:
        if dist.is_main:
            if tmp.path.exists():  # debris of a killed run
                shutil.rmtree(tmp.path)
            tmp.train_state.mkdir(parents=True)
        dist.barrier()
        save_state(tmp.train_state)
        dist.barrier()  # every process has written and closed its files
        if dist.is_main:
            save_drafter(drafter, tmp.path, state_dict=state_dict, dtype=getattr(torch, save_dtype),
                         selector_shrink=selector_shrink)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp.state_file(tmp.EXACT_WEIGHTS)))
            write_json(tmp.state, {**state, "train_state_format": TRAIN_STATE_FORMAT})
            if manifest is not None:
                write_json(tmp.manifest, manifest)
            _fsync_tree(tmp.path)
            if final.exists():  # re-saving a step (e.g. after a resume): swap, never delete first
                old = final.parent / f".old-{final.name}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp.path, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp.path, final)
    except OSError as e:
        if dist.is_main:
            shutil.rmtree(tmp.path, ignore_errors=True)
        hint = "the disk is full; free space" if e.errno == errno.ENOSPC else "check the run folder"
        raise CheckpointError(f"writing checkpoint step {step} failed ({e}); {hint}. The previous checkpoint "
                              f"is untouched and remains valid") from e
    return final


def mark_best(run: RunLayout, step: int, tau: float) -> None:
    write_json(run.best, {"step": step, "tau": tau}, indent=None)


def prune(run: RunLayout, keep_last: int) -> None:
    """Delete all but the newest keep_last step checkpoints (never the best one), and temp debris."""
    keep = {s for s, _ in run.list_checkpoints()[-keep_last:]}
    best = best_step(run)
    if best is not None:
        keep.add(best)
    for s, p in run.list_checkpoints():
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for debris in run.checkpoints.glob(".tmp-*"):
        shutil.rmtree(debris, ignore_errors=True)


def load_train_state(path: Path) -> dict:
    """What resuming reads before the drafter is wrapped: `state` (the loop state), `manifest`, `weights` (the
    float32 ones; None in checkpoints older than them) and `train_state` (the folder accelerate's load_state
    reads the optimizer, scheduler and RNG from, once the model is prepared). A format-1 checkpoint has no
    accelerate files; its `optimizer`, `scheduler` and `rng` (the main process's) are read here, tensors only
    (weights_only=True)."""
    check_complete(path, need_state=True)
    ck = CheckpointLayout(path)
    out = {"state": read_state(path), "train_state": ck.train_state, "manifest": training_manifest(path)}
    try:
        if train_state_format(out["state"]) == 1:
            for name in ("optimizer", "scheduler", "rng"):
                file = ck.state_file(f"{name}.pt")
                out[name] = torch.load(file, map_location="cpu", weights_only=True)
        else:  # read here because accelerate's load_state passes over an unreadable RNG file in silence
            from accelerate.utils import load  # torch.load(weights_only=True) that admits numpy's RNG state

            for rank in range(out["state"]["world_size"]):
                load(ck.state_file(ck.rng_file(rank)))
    except Exception as e:
        raise CheckpointError(f"cannot read the training state of {path} ({e}); it is corrupt. Resume from "
                              f"another checkpoint") from e
    exact = ck.state_file(ck.EXACT_WEIGHTS)
    try:
        out["weights"] = load_file(str(exact)) if exact.exists() else None
    except Exception as e:
        raise CheckpointError(f"cannot read {exact} ({e}); it is corrupt. Resume from another checkpoint") from e
    return out


def check_resumable(path: Path, state: dict, distributed: str, world_size: int) -> None:
    """Refuse a checkpoint (its loop `state`) whose optimizer state a run under `distributed` (ddp or fsdp, as
    accelerate actually runs it) cannot load; warn where the resumed run will differ."""
    written = state.get("distributed", "ddp")  # format 1 did not record it: FSDP never ran then
    if train_state_format(state) == 1 and distributed == "fsdp":
        raise ConfigError(f"checkpoint {path} has the first train_state/ layout (optimizer.pt, rng.pt: the main "
                          f"process's state only), which cannot resume under train.distributed=fsdp; resume it "
                          f"with train.distributed=ddp (its next checkpoint has the current layout)")
    if written != distributed:
        raise ConfigError(f"checkpoint {path} was written under train.distributed={written} (on "
                          f"{state.get('world_size')} processes), and its optimizer state is stored for that; resume "
                          f"it with train.distributed={written}")
    if state.get("world_size") != world_size:
        log.warning("resuming a %s-process run on %d processes: the data order changes from here on, and "
                    "processes without a saved RNG state start from a fresh one", state.get("world_size"), world_size)
