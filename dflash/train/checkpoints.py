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
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.dist import Dist
from dflash.drafter.build import save_drafter
from dflash.errors import CheckpointError, ConfigError
from dflash.io import read_json, write_json
from dflash.layout import STEP_DIR, CheckpointLayout, RunLayout

log = logging.getLogger(__name__)

TRAIN_STATE_FORMAT = 2
"""state.json's train_state_format: 2 = optimizer, scheduler and every process's RNG through accelerate's
save_state; 1 (no key) = the main process's optimizer.pt, scheduler.pt and rng.pt."""


def parse_step(name: str) -> int | None:
    """step20k / step20000 / step-020000 / 20000 -> 20000; anything else -> None."""
    m = re.fullmatch(r"(?:step-?)?(\d+)(k?)", name.strip().lower())
    if not m:
        return None
    return int(m.group(1)) * (1000 if m.group(2) else 1)


def best_step(run: RunLayout) -> int | None:
    return read_json(run.best)["step"] if run.best.exists() else None


def resolve_checkpoint(run: RunLayout | None, name: str) -> Path:
    """latest, best, stepN/stepNk, or a path to any drafter directory (z-lab layout)."""
    as_path = Path(name).expanduser()
    if ("/" in name or name.startswith(".")) or (as_path.is_dir() and not name.startswith("step")):
        if not as_path.is_dir():
            raise CheckpointError(f"checkpoint path {name} does not exist")
        return as_path
    if run is None:
        raise CheckpointError(f"checkpoint={name} needs a run: set run.name, or give a drafter directory path")
    available = run.list_checkpoints()
    names = ", ".join(f"step{s}" for s, _ in available) or "none"
    if name == "latest":
        if not available:
            raise CheckpointError(f"run {run.path} has no checkpoints yet (available: none)")
        return available[-1][1]
    if name == "best":
        step = best_step(run)
        if step is None:
            raise CheckpointError(f"run {run.path} has no best checkpoint yet (no held-out eval has run); "
                                  f"available: {names}")
        name = str(step)
    step = parse_step(name)
    for s, p in available:
        if s == step:
            return p
    raise CheckpointError(f"no checkpoint {name!r} in {run.path}; available: {names} (also latest, best, "
                          f"or a path to a drafter directory)")


def check_complete(path: Path, need_state: bool = False) -> None:
    """Refuse a checkpoint that lacks a file the drafter (or, need_state, resuming) needs, naming it."""
    ck = CheckpointLayout(path)
    wanted = set(ck.DRAFTER_FILES)
    if need_state:
        wanted.add("train_state/state.json")
        if ck.state.exists():
            state = _read_state(path)
            if train_state_format(state) == 1:
                wanted = ck.format1_files()
            else:
                wanted = ck.files(with_manifest=False, world_size=state["world_size"],
                                  fsdp=state.get("distributed") == "fsdp")
    missing = sorted((f for f in wanted if not (path / f).exists()), key=lambda f: (f.count("/"), f))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; it is incomplete or not a "
                              f"dflash checkpoint. Pick another (e.g. train.resume=step<N>) or delete it")


def train_state_format(state: dict) -> int:
    return state.get("train_state_format", 1)


def _read_state(path: Path) -> dict:
    try:
        state = read_json(CheckpointLayout(path).state)
    except Exception as e:
        raise CheckpointError(f"cannot read the training state of {path} ({e}); it is corrupt. Resume from "
                              f"another checkpoint") from e
    if train_state_format(state) > TRAIN_STATE_FORMAT:
        raise CheckpointError(f"checkpoint {path} has train_state_format {train_state_format(state)}, written by "
                              f"a newer dflash than this one (format {TRAIN_STATE_FORMAT}); update dflash to resume it")
    return state


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(run: RunLayout, step: int, drafter, state_dict: dict, state: dict | None,
                    manifest: dict | None, save_dtype: str = "bfloat16",
                    save_state: Callable[[Path], None] = lambda folder: None, dist: Dist | None = None) -> Path:
    """Write checkpoint `step` atomically; returns its directory. Every process calls this: each writes its
    part of train_state/ through `save_state(folder)` (accelerate's save_state: optimizer and scheduler from the
    main process, each process's RNG; under FSDP gathering the shards, a collective), then the main process
    writes the drafter (servable weights cast to `save_dtype`), the float32 weights, `state` and `manifest`
    (which only it needs to hold), fsyncs and renames. The other processes return before the rename. With
    several nodes the run folder must be one filesystem they share (each process writes its own RNG file)."""
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
            save_drafter(drafter, tmp.path, state_dict=state_dict, dtype=getattr(torch, save_dtype))
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
    out = {"state": _read_state(path), "train_state": ck.train_state, "manifest": training_manifest(path)}
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


def training_manifest(path: Path) -> dict | None:
    """The manifest of the features a checkpoint was trained on (None for foreign drafters)."""
    p = CheckpointLayout(path).manifest
    return read_json(p) if p.exists() else None


def checkpoint_step(path: Path) -> int | None:
    ck = CheckpointLayout(path)
    if ck.state.exists():
        return read_json(ck.state)["step"]
    m = STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None
