"""The on-disk layouts, owned here once: a run folder, a checkpoint in it, a feature cache.

    runs/<name>/                       RunLayout
      config.yaml  run.json  metrics.jsonl  train.log  wandb/
      checkpoints/best.json
      checkpoints/step-020000/         CheckpointLayout: config.json + model.safetensors (z-lab)
        train_state/                   state.json weights_fp32.safetensors manifest.json (dflash's)
                                       optimizer.bin scheduler.bin random_states_<rank>.pkl
                                       [pytorch_model_fsdp.bin under FSDP] (accelerate's save_state)
      eval/step-020000/                summary.json blocks.jsonl *.png (the run's own settings; other
                                       settings beside it: step-020000-<tag>, dflash.evaluate.settings)
    cache/<target>/<data>/features/    CacheLayout: manifest.json, shard-00000.safetensors + .json
                                       verified/rank-00000.json (what each process verified)
    cache/<target>/eval-.../           the held-out set (completions.jsonl, features-L.../)
    $DFLASH_HOME/ (~/.cache/dflash)    home(): targets/<name> (built-in targets), compile-cache/{triton,inductor}

Paths only: nothing here reads or writes (home() reads $DFLASH_HOME).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dflash.config.renamed import migrate_tree

STEP_DIR = re.compile(r"step-(\d+)")


COMPILE_CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
"""The compile caches' environment variables and their folder in the compile cache (run.compile_cache)."""


def home() -> Path:
    """dflash's own folder across runs: $DFLASH_HOME, else ~/.cache/dflash."""
    return Path(os.environ.get("DFLASH_HOME") or "~/.cache/dflash").expanduser()


def compile_cache_dirs(root: str | Path | None = None) -> dict[str, Path]:
    """{TRITON_CACHE_DIR: <root>/triton, TORCHINDUCTOR_CACHE_DIR: <root>/inductor}; root None = home()/compile-cache."""
    base = Path(root).expanduser() if root else home() / "compile-cache"
    return {var: base / folder for var, folder in COMPILE_CACHES.items()}


def step_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointLayout:
    """One checkpoint: the servable drafter (z-lab layout) plus what resuming needs."""

    path: Path

    DRAFTER_FILES = ("config.json", "model.safetensors")
    """What a drafter needs to load (in any z-lab-layout folder, published drafters included)."""
    SERVING_FILES = ("modeling_dflash.py", "dflash2.py", "attention.py")
    """What dflash adds so AutoModel(trust_remote_code=True) builds the drafter (auto_map in config.json): the
    drafter module and the DFlash 2 parts and the attention it imports."""
    LATER_FILES = ("dflash2.py", "attention.py")
    """Written since the drafter module imports them (dflash2.py since DFlash 2, attention.py since the attention
    left the model file): checkpoints from before resume and evaluate without them (their modeling_dflash.py holds
    what it needs)."""
    STATE_FILES = ("state.json", "weights_fp32.safetensors")
    """dflash's own train_state/ files: the loop state (step, best tau, world size, format) and EXACT_WEIGHTS."""
    EXACT_WEIGHTS = "weights_fp32.safetensors"
    """train_state/ copy of the float32 weights that resuming continues from (model.safetensors may be bf16)."""
    ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin")
    """accelerate's save_state, from the main process: the optimizer state (under FSDP gathered whole, so it
    loads on any number of processes) and the LR schedule. The names are accelerate's."""
    FSDP_FILES = ("pytorch_model_fsdp.bin",)
    """accelerate's save_state under FSDP: the gathered float32 model, which load_state hands back to the shards."""
    FORMAT1_FILES = ("optimizer.pt", "scheduler.pt", "rng.pt", "state.json")
    """train_state/ of checkpoints written before accelerate's save_state (train_state_format 1): the main
    process's optimizer state and RNG only. They still resume under DDP."""

    @staticmethod
    def rng_file(rank: int) -> str:
        """accelerate's save_state: process `rank`'s RNG states (python, numpy, torch, CUDA)."""
        return f"random_states_{rank}.pkl"

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def train_state(self) -> Path:
        return self.path / "train_state"

    def state_file(self, name: str) -> Path:
        return self.train_state / name

    @property
    def state(self) -> Path:
        return self.train_state / "state.json"

    @property
    def manifest(self) -> Path:
        """The manifest of the features this drafter was trained on."""
        return self.train_state / "manifest.json"

    def files(self, with_manifest: bool = True, world_size: int = 1, fsdp: bool = False) -> set[str]:
        """Every file a complete dflash checkpoint holds, relative to its folder, as written by `world_size`
        processes under DDP or (fsdp) FSDP."""
        state = (*self.STATE_FILES, *self.ACCELERATE_FILES, *(self.FSDP_FILES if fsdp else ()),
                 *(self.rng_file(rank) for rank in range(world_size)))
        names = {*self.DRAFTER_FILES, *self.SERVING_FILES, *(f"train_state/{f}" for f in state)}
        return names | ({"train_state/manifest.json"} if with_manifest else set())

    def format1_files(self) -> set[str]:
        """What resuming needs of a checkpoint in the first train_state/ layout (FORMAT1_FILES)."""
        return {*self.DRAFTER_FILES, *(f"train_state/{f}" for f in self.FORMAT1_FILES)}


@dataclass(frozen=True)
class RunLayout:
    """runs/<name>/: everything one training run and its evaluations write."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    def trained_config(self) -> dict:
        """config.yaml as a plain dict (the resolved config the run was trained with); {} when it has none. Keys that
        have since moved into a sub-group (eval.temperature, loss.selector_shrink) are read under their new names
        (dflash.config.renamed)."""
        if not self.config.exists():
            return {}
        from omegaconf import OmegaConf

        return migrate_tree(OmegaConf.to_container(OmegaConf.load(self.config)) or {})

    @property
    def info(self) -> Path:
        """run.json: name, created, git commit, W&B run id/project/entity/group, the modes training resolved
        (gradient_checkpointing; conv_kernel for DFlash 2)."""
        return self.path / "run.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def best(self) -> Path:
        return self.checkpoints / "best.json"

    def checkpoint(self, step: int) -> CheckpointLayout:
        return CheckpointLayout(self.checkpoints / step_name(step))

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every step checkpoint, oldest first."""
        found = []
        for p in self.checkpoints.glob("step-*") if self.checkpoints.is_dir() else []:
            m = STEP_DIR.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def eval_dir(self, name: str) -> Path:
        """eval/<name>/: `step-020000` (teacher-forced, at the run's own settings), `step-020000-live`, either with
        the tag of other settings (`step-020000-2prompts`, `-t1`: dflash.evaluate.settings), or a foreign drafter's
        name."""
        return self.path / "eval" / name

    def eval_summaries(self) -> list[Path]:
        return sorted(self.path.glob("eval/step-*/summary.json"))

    def step_evaluations(self) -> list[tuple[int, Path]]:
        """(step, summary.json) of the run's evaluations at its own settings (eval/step-<digits>: in-run, or
        evaluate.py at the same settings), oldest first; not those at other settings, which evaluate.py writes beside
        them (step-000768-t1, -2prompts, -live, -2: dflash.evaluate.settings), nor earlier ones kept aside (.<date>)."""
        found = []
        for p in self.eval_summaries():
            m = STEP_DIR.fullmatch(p.parent.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunLayout:
        """The run folder a checkpoint folder sits in (`is_run()` is false for a drafter outside any run)."""
        return cls(Path(checkpoint).expanduser().resolve().parent.parent)

    def is_run(self) -> bool:
        return self.info.exists()


@dataclass(frozen=True)
class CacheLayout:
    """A feature cache folder: manifest.json, and per shard its safetensors file and JSON sidecar."""

    path: Path

    @property
    def manifest(self) -> Path:
        return self.path / "manifest.json"

    @staticmethod
    def shard_name(k: int) -> str:
        return f"shard-{k:05d}.safetensors"

    def shard(self, k: int) -> Path:
        return self.path / self.shard_name(k)

    def sidecar(self, k: int) -> Path:
        return self.path / f"shard-{k:05d}.json"

    def sidecars(self) -> list[Path]:
        return sorted(self.path.glob("shard-*.json"))

    def stamp(self, rank: int) -> Path:
        """verified/rank-00003.json: what process 3 verified of this cache (dflash.data.cache.Stamp)."""
        return self.path / "verified" / f"rank-{rank:05d}.json"

    def stamps(self) -> list[Path]:
        return sorted((self.path / "verified").glob("rank-*.json"))

    @property
    def target_root(self) -> Path:
        """cache/<target>/ for the default cache/<target>/<data>/features (home of the held-out sets)."""
        return self.path.parent.parent
