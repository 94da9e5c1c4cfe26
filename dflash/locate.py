"""Which checkpoint a `checkpoint=` or `train.resume=` value names, and what a checkpoint folder says
about itself (complete or not, its step, its training state's format, the features it trained on).

Evaluation and training both read checkpoints; only training writes them (dflash.train.checkpoints).
The folder layout is dflash.layout's.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash.errors import CheckpointError
from dflash.io import read_json
from dflash.layout import STEP_DIR, CheckpointLayout, RunLayout

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
            state = read_state(path)
            if train_state_format(state) == 1:
                wanted = ck.format1_files()
            else:
                wanted = ck.files(with_manifest=False, world_size=state["world_size"],
                                  fsdp=state.get("distributed") == "fsdp") - set(ck.LATER_FILES)
    missing = sorted((f for f in wanted if not (path / f).exists()), key=lambda f: (f.count("/"), f))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; it is incomplete or not a "
                              f"dflash checkpoint. Pick another (e.g. train.resume=step<N>) or delete it")


def train_state_format(state: dict) -> int:
    return state.get("train_state_format", 1)


def read_state(path: Path) -> dict:
    try:
        state = read_json(CheckpointLayout(path).state)
    except Exception as e:
        raise CheckpointError(f"cannot read the training state of {path} ({e}); it is corrupt. Resume from "
                              f"another checkpoint") from e
    if train_state_format(state) > TRAIN_STATE_FORMAT:
        raise CheckpointError(f"checkpoint {path} has train_state_format {train_state_format(state)}, written by "
                              f"a newer dflash than this one (format {TRAIN_STATE_FORMAT}); update dflash to resume it")
    return state


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
