"""The run folder and tracking: runs/<name>/{config.yaml, run.json, metrics.jsonl, train.log},
and the W&B run that training creates and evaluation resumes.

Every metric goes to metrics.jsonl (also with W&B off). In W&B, train/* and eval/* are plotted
against `train/step` (define_metric), so evaluating an old checkpoint later logs at that
checkpoint's training step without fighting W&B's own monotonic step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dflash.config import JobConfig, LoggerConfig

log = logging.getLogger(__name__)

SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")


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
        return {k: ("<redacted>" if any(m in str(k).lower() for m in SECRET_MARKERS) and isinstance(v, str)
                    else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


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


def _swept_keys() -> set[str]:
    """Keys the command line sweeps over (`optim.lr=3e-4,6e-4`, `range(...)`, `choice(...)`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    try:
        return {o.get_key_element() for o in OverridesParser.create().parse_overrides(args) if o.is_sweep_override()}
    except Exception:  # an unparsable argument: Hydra itself will have said so
        return set()


def sweep_info() -> tuple[str | None, list[str]]:
    """(sweep name, this job's values of the swept keys) under Hydra multirun; (None, []) otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            swept = _swept_keys()
            return Path(hc.sweep.dir).name, [o for o in hc.overrides.task if o.split("=", 1)[0] in swept]
    except (ValueError, ImportError):
        pass
    return None, []


def default_run_name(job: JobConfig) -> str:
    """<date>-<time>-<target>; in a sweep, <sweep>-<swept key=value,...> (last key component)."""
    sweep, overrides = sweep_info()
    if sweep:
        parts = [f"{o.split('=', 1)[0].split('.')[-1]}={o.split('=', 1)[1]}" for o in overrides]
        name = f"{sweep}-{','.join(parts) or job.target.name}"
    else:
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{job.target.name}"
    return name.replace("/", "_")[:120]


def latest_run(root: Path) -> Path:
    runs = [p for p in root.iterdir() if (p / "run.json").exists()] if root.is_dir() else []
    if not runs:
        raise FileNotFoundError(f"no runs under {root}; train one first, or give run.name / a checkpoint path")
    return max(runs, key=lambda p: json.loads((p / "run.json").read_text()).get("created", ""))


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


class RunLogger:
    """Writes metrics.jsonl and (on the main process) logs to W&B."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, job: JobConfig | None, main: bool = True,
                 job_type: str = "train"):
        self.run_dir, self.cfg, self.main = run_dir, cfg, main
        self.wandb = None
        if not main:
            return
        run_json = run_dir / "run.json"
        info = json.loads(run_json.read_text()) if run_json.exists() else {}
        if cfg.backend == "wandb" and cfg.mode != "disabled":
            self.wandb = self._start_wandb(info, job, job_type)
            info.update({"wandb_id": self.wandb.id, "wandb_project": cfg.project, "wandb_entity": cfg.entity,
                         "wandb_mode": cfg.mode})
        info.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        info.setdefault("git_commit", git_commit())
        info.setdefault("name", run_dir.name)
        write_json(run_json, info)

    def _start_wandb(self, info: dict, job: JobConfig | None, job_type: str):
        import wandb

        sweep, overrides = sweep_info()
        group = self.cfg.group or info.get("wandb_group") or sweep
        info["wandb_group"] = group
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(
            project=info.get("wandb_project") or self.cfg.project, entity=info.get("wandb_entity") or self.cfg.entity,
            id=info.get("wandb_id"), resume="allow", name=self.run_dir.name, group=group,
            tags=list(self.cfg.tags) + overrides, dir=str(self.run_dir), mode=self.cfg.mode, job_type=job_type,
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
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({**metrics, "train/step": step})

    def log_media(self, items: dict, step: int) -> None:
        """W&B-only objects (tables, images, plots) at a training step."""
        if self.wandb is not None and items:
            self.wandb.log({**items, "train/step": step})

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            self.wandb.summary.update(values)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def print_table(rows: list[list], header: list[str], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in header]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        out.write("  ".join(c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")
