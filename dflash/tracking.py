"""Tracking a run: logging set-up, run names, run.json, metrics.jsonl and the W&B run that
training creates and evaluation resumes (the folder itself is dflash.layout.RunLayout).

Every metric goes to metrics.jsonl (also with W&B off). In W&B, train/* and eval/* are plotted
against `train/step` (define_metric), so evaluating an old checkpoint later logs at that
checkpoint's training step without fighting W&B's own monotonic step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from dflash.config import JobConfig, LoggerConfig, TargetConfig
from dflash.errors import NotFoundError
from dflash.io import read_json, write_json
from dflash.layout import COMPILE_CACHES, RunLayout

log = logging.getLogger(__name__)

SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")
NOT_SECRETS = ("mask_token",)
"""Config keys with a marker in their name that hold no credential (target.mask_token: the mask token's text, which
evaluate.py reads back from the run's config.yaml and checks against the tokenizer)."""


def setup_logging(log_file: Path | None = None, main: bool = True) -> None:
    """INFO to stderr (WARNING on non-main processes), and to log_file when given."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if main else logging.WARNING)
    if log_file is not None and not any(getattr(h, "baseFilename", None) == str(log_file) for h in root.handlers):
        fh = logging.FileHandler(log_file)
        fh.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(fh)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def scrub(obj):
    """Drop values under keys that look like credentials (they never belong in a run folder)."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _secret(str(k).lower()) and isinstance(v, str) else scrub(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def _secret(key: str) -> bool:
    return key not in NOT_SECRETS and any(m in key for m in SECRET_MARKERS)


def config_dict(job: JobConfig) -> dict:
    return scrub(asdict(job))


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def sweep_info() -> tuple[str | None, str, list[str]]:
    """Under Hydra multirun: (sweep name, this job's `hydra.job.override_dirname`, its overrides as
    a list); (None, "", []) otherwise. Keys in hydra.job.config.override_dirname.exclude_keys (run
    bookkeeping: paths, logger, run name) are left out of both."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            exclude = set(hc.job.config.override_dirname.exclude_keys)
            overrides = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") not in exclude]
            return Path(hc.sweep.dir).name, hc.job.override_dirname or str(hc.job.num), overrides
    except (ValueError, ImportError):
        pass
    return None, "", []


MAX_RUN_NAME = 200  # file systems allow 255 bytes


def default_run_name(target: TargetConfig) -> str:
    """<date>-<time>-<target>; in a sweep, <sweep>-<override_dirname> (e.g. 20261130-101500-optim.lr:3e-4),
    with any character but letters, digits and `_.:+-` made `_` (so the name survives list syntax such
    as runs=[a,b] and the shell), shortened with a hash of the whole when longer than MAX_RUN_NAME."""
    sweep, dirname, _ = sweep_info()
    name = f"{sweep}-{dirname}" if sweep else f"{time.strftime('%Y%m%d-%H%M%S')}-{target.name}"
    name = re.sub(r"[^A-Za-z0-9_.:+-]", "_", name)
    if len(name) > MAX_RUN_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[:MAX_RUN_NAME - 9]}-{digest}"
    return name


def latest_run(root: Path) -> RunLayout:
    """The most recently created run under `root` that has a checkpoint (a run that failed before its
    first checkpoint has nothing to evaluate or resume)."""
    runs = [RunLayout(p) for p in root.iterdir() if RunLayout(p).is_run()] if root.is_dir() else []
    if not runs:
        raise NotFoundError(f"no runs under {root}; train one first, or give run.name / a checkpoint path")
    with_checkpoints = [r for r in runs if r.list_checkpoints()]
    if not with_checkpoints:
        raise NotFoundError(f"no run under {root} has a checkpoint yet (runs: {', '.join(sorted(r.name for r in runs))})"
                            f"; train one further, or give run.name / a checkpoint path")
    return max(with_checkpoints, key=lambda r: read_json(r.info).get("created", ""))


class Progress:
    """A progress bar on a terminal; elsewhere (a job log) a line at most every `every_s` seconds, with the rate
    and the time left at that rate (`line`)."""

    every_s = 30.0

    def __init__(self, total: int, desc: str, unit: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=None)
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        self.start = self.last = time.time()

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)
        if self.bar.disable and (time.time() - self.last >= self.every_s or self.done == self.total):
            self.last = time.time()
            log.info("%s", self.line(self.last - self.start))

    def line(self, elapsed: float) -> str:
        """'desc: done/total unit (elapsed s, rate unit/s, ETA h:mm:ss)' after `elapsed` seconds."""
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "?" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left)).lstrip("0:") or "0"
        return (f"{self.desc}: {self.done}/{self.total} {self.unit} ({elapsed:.0f} s, {rate:.3g} {self.unit}/s, "
                f"ETA {eta})")

    def close(self) -> None:
        self.bar.close()


def record_run(run: RunLayout, **fields) -> dict:
    """Merge `fields` into run.json (written only here); name, created and git commit are set once."""
    info = read_json(run.info) if run.info.exists() else {}
    info.update(fields)
    info.setdefault("name", run.name)
    info.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.setdefault("git_commit", git_commit())
    write_json(run.info, info)
    return info


class RunLogger:
    """Writes metrics.jsonl and (on the main process) logs to W&B, into the run's one W&B run."""

    def __init__(self, run: RunLayout, cfg: LoggerConfig, job: JobConfig | None, main: bool = True,
                 job_type: str = "train"):
        self.run, self.cfg, self.main = run, cfg, main
        self.wandb = None
        if not main:
            return
        info = read_json(run.info) if run.info.exists() else {}
        # where this process's compiled kernels go (dflash.cli.use_compile_caches): a slow first step is explained
        fields = {"compile_cache": {var: os.environ.get(var) for var in COMPILE_CACHES}}
        if cfg.backend == "wandb" and cfg.mode != "disabled":
            sweep, _, overrides = sweep_info()
            group = cfg.group or info.get("wandb_group") or sweep
            self.wandb = self._start_wandb(info, job, job_type, group, overrides)
            fields |= {"wandb_id": self.wandb.id, "wandb_project": cfg.project, "wandb_entity": cfg.entity,
                       "wandb_mode": cfg.mode, "wandb_group": group}
        record_run(run, **fields)

    def _start_wandb(self, info: dict, job: JobConfig | None, job_type: str, group: str | None,
                     overrides: list[str]):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(
            project=info.get("wandb_project") or self.cfg.project, entity=info.get("wandb_entity") or self.cfg.entity,
            id=info.get("wandb_id"), resume="allow", name=self.run.name, group=group,
            tags=list(self.cfg.tags) + overrides, dir=str(self.run.path), mode=self.cfg.mode, job_type=job_type,
            config=config_dict(job) if job is not None and job_type == "train" else None)
        run.define_metric("train/step")
        run.define_metric("train/*", step_metric="train/step")
        run.define_metric("eval/*", step_metric="train/step")
        return run

    def log(self, metrics: dict, step: int) -> None:
        if not self.main:
            return
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()})
        with self.run.metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({**metrics, "train/step": step})

    def log_media(self, items: dict, step: int) -> None:
        """W&B-only objects (tables, images, plots) at a training step."""
        if self.wandb is not None and items:
            self.wandb.log({**items, "train/step": step})

    def log_checkpoint(self, path: Path, step: int, aliases: list[str]) -> None:
        """A checkpoint as a W&B model artifact: a reference to its folder (no upload of weights)."""
        if self.wandb is None:
            return
        import wandb

        art = wandb.Artifact(re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.run.name}-drafter")[:120], type="model",
                             metadata={"step": step, "path": str(Path(path).resolve())})
        art.add_reference(Path(path).resolve().as_uri(), checksum=False)
        self.wandb.log_artifact(art, aliases=aliases)

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            self.wandb.summary.update(values)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(run: RunLayout) -> list[dict]:
    path = run.metrics
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
