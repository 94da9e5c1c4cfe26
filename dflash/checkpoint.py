"""Checkpoints: runs/<name>/checkpoints/step-XXXXXX/ = the drafter in z-lab layout
(config.json + model.safetensors, servable as is) + train_state/ (optimizer, scheduler, RNG,
data position, the manifest of the training features).

Writes are atomic: everything goes to a hidden temp directory, is fsynced, then renamed into
place, so a crash or a full disk never leaves a half-written checkpoint, and the previous one
stays valid. The newest `keep_last` are kept, plus the one named in best.json.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

REQUIRED_FILES = ("config.json", "model.safetensors")
STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng.pt", "state.json")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read or written; the message says which and what to do."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "checkpoints"
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def parse_step(name: str) -> int | None:
    """step20k / step20000 / step-020000 / 20000 -> 20000; anything else -> None."""
    m = re.fullmatch(r"(?:step-?)?(\d+)(k?)", name.strip().lower())
    if not m:
        return None
    return int(m.group(1)) * (1000 if m.group(2) else 1)


def best_step(run_dir: Path) -> int | None:
    path = run_dir / "checkpoints" / "best.json"
    return json.loads(path.read_text())["step"] if path.exists() else None


def resolve_checkpoint(run_dir: Path | None, name: str) -> Path:
    """latest, best, stepN/stepNk, or a path to any drafter directory (z-lab layout)."""
    as_path = Path(name).expanduser()
    if ("/" in name or name.startswith(".")) or (as_path.is_dir() and not name.startswith("step")):
        if not as_path.is_dir():
            raise CheckpointError(f"checkpoint path {name} does not exist")
        return as_path
    if run_dir is None:
        raise CheckpointError(f"checkpoint={name} needs a run: set run.name, or give a drafter directory path")
    available = list_checkpoints(run_dir)
    names = ", ".join(f"step{s}" for s, _ in available) or "none"
    if name == "latest":
        if not available:
            raise CheckpointError(f"run {run_dir} has no checkpoints yet (available: none)")
        return available[-1][1]
    if name == "best":
        step = best_step(run_dir)
        if step is None:
            raise CheckpointError(f"run {run_dir} has no best checkpoint yet (no held-out eval has run); "
                                  f"available: {names}")
        name = str(step)
    step = parse_step(name)
    for s, p in available:
        if s == step:
            return p
    raise CheckpointError(f"no checkpoint {name!r} in {run_dir}; available: {names} (also latest, best, "
                          f"or a path to a drafter directory)")


def check_complete(path: Path, need_state: bool = False) -> None:
    missing = [f for f in REQUIRED_FILES if not (path / f).exists()]
    if need_state:
        missing += [f"train_state/{f}" for f in STATE_FILES if not (path / "train_state" / f).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; it is incomplete or not a "
                              f"dflash checkpoint. Pick another (e.g. train.resume=step<N>) or delete it")


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(run_dir: Path, step: int, drafter, state_dict: dict, optimizer_state: dict,
                    scheduler_state: dict, rng_state: dict, state: dict, manifest: dict | None) -> Path:
    """Write checkpoint `step` atomically; returns its directory."""
    final = step_dir(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "train_state").mkdir(parents=True)
        drafter.save_pretrained(tmp, state_dict=state_dict)
        torch.save(optimizer_state, tmp / "train_state" / "optimizer.pt")
        torch.save(scheduler_state, tmp / "train_state" / "scheduler.pt")
        torch.save(rng_state, tmp / "train_state" / "rng.pt")
        (tmp / "train_state" / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        if manifest is not None:
            (tmp / "train_state" / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, never delete first
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        hint = "the disk is full; free space" if e.errno == errno.ENOSPC else "check the run folder"
        raise CheckpointError(f"writing checkpoint step {step} failed ({e}); {hint}. The previous checkpoint "
                              f"is untouched and remains valid") from e
    return final


def mark_best(run_dir: Path, step: int, tau: float) -> None:
    path = run_dir / "checkpoints" / "best.json"
    tmp = path.with_name(".best.json.tmp")
    tmp.write_text(json.dumps({"step": step, "tau": tau}))
    os.replace(tmp, path)


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest keep_last step checkpoints (never the best one), and temp debris."""
    keep = {s for s, _ in list_checkpoints(run_dir)[-keep_last:]}
    best = best_step(run_dir)
    if best is not None:
        keep.add(best)
    for s, p in list_checkpoints(run_dir):
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for debris in (run_dir / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(debris, ignore_errors=True)


def load_train_state(path: Path) -> dict:
    """Optimizer, scheduler, RNG and loop state of a checkpoint; tensors only (weights_only=True)."""
    check_complete(path, need_state=True)
    ts = path / "train_state"
    try:
        out = {name: torch.load(ts / f"{name}.pt", map_location="cpu", weights_only=True)
               for name in ("optimizer", "scheduler", "rng")}
        out["state"] = json.loads((ts / "state.json").read_text())
    except Exception as e:
        raise CheckpointError(f"cannot read the training state of {path} ({e}); it is corrupt. Resume from "
                              f"another checkpoint") from e
    manifest = ts / "manifest.json"
    out["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else None
    return out


def training_manifest(path: Path) -> dict | None:
    """The manifest of the features a checkpoint was trained on (None for foreign drafters)."""
    p = path / "train_state" / "manifest.json"
    return json.loads(p.read_text()) if p.exists() else None


def checkpoint_step(path: Path) -> int | None:
    p = path / "train_state" / "state.json"
    if p.exists():
        return json.loads(p.read_text())["step"]
    m = re.fullmatch(r"step-(\d+)", path.name)
    return int(m.group(1)) if m else None
