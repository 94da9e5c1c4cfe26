"""Checkpoints: runs/<name>/checkpoints/step-XXXXXX/ = the drafter in z-lab layout
(config.json + model.safetensors, servable as is) + train_state/ (optimizer, scheduler, RNG,
data position, the manifest of the training features); see dflash.layout.

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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.drafter.build import save_drafter
from dflash.errors import CheckpointError
from dflash.io import read_json, write_json
from dflash.layout import STEP_DIR, CheckpointLayout, RunLayout

log = logging.getLogger(__name__)


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
    ck = CheckpointLayout(path)
    wanted = ck.files(with_manifest=False) if need_state else set(ck.DRAFTER_FILES)
    missing = sorted((f for f in wanted if not (path / f).exists()), key=lambda f: (f.count("/"), f))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; it is incomplete or not a "
                              f"dflash checkpoint. Pick another (e.g. train.resume=step<N>) or delete it")


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(run: RunLayout, step: int, drafter, state_dict: dict, optimizer_state: dict,
                    scheduler_state: dict, rng_state: dict, state: dict, manifest: dict | None,
                    save_dtype: str = "bfloat16") -> Path:
    """Write checkpoint `step` atomically; returns its directory. The servable weights are cast to
    `save_dtype`; train_state/ keeps the float32 ones."""
    final = run.checkpoint(step).path
    tmp = CheckpointLayout(final.parent / f".tmp-{final.name}-{os.getpid()}")
    try:
        if tmp.path.exists():
            shutil.rmtree(tmp.path)
        tmp.train_state.mkdir(parents=True)
        save_drafter(drafter, tmp.path, state_dict=state_dict, dtype=getattr(torch, save_dtype))
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp.state_file(tmp.EXACT_WEIGHTS)))
        torch.save(optimizer_state, tmp.state_file("optimizer.pt"))
        torch.save(scheduler_state, tmp.state_file("scheduler.pt"))
        torch.save(rng_state, tmp.state_file("rng.pt"))
        write_json(tmp.state, state)
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
    """Optimizer, scheduler, RNG and loop state of a checkpoint; tensors only (weights_only=True)."""
    check_complete(path, need_state=True)
    ck = CheckpointLayout(path)
    files = {name: ck.state_file(f"{name}.pt") for name in ("optimizer", "scheduler", "rng")}
    try:
        out = {name: torch.load(file, map_location="cpu", weights_only=True) for name, file in files.items()}
        out["state"] = read_json(ck.state)
    except Exception as e:
        raise CheckpointError(f"cannot read the training state of {path} ({e}); it is corrupt. Resume from "
                              f"another checkpoint") from e
    out["manifest"] = training_manifest(path)
    exact = ck.state_file(ck.EXACT_WEIGHTS)
    try:
        out["weights"] = load_file(str(exact)) if exact.exists() else None
    except Exception as e:
        raise CheckpointError(f"cannot read {exact} ({e}); it is corrupt. Resume from another checkpoint") from e
    return out


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
