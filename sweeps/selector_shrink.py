"""The served selector's shrink (loss.selector.shrink) tried on trained DFlash 2 checkpoints, without retraining.

    python sweeps/selector_shrink.py runs/selector/speculators-s0 0.45 0.6 0.75 1.0 [evaluate.py overrides ...]

The shrink only scales what a checkpoint serves (its predecessor codebook; training is the same at every value),
so each value's drafter is the run's final checkpoint with its trained codebook (train_state's float32 copy)
times the value, written beside the run (<run>/shrink/<value>/) and evaluated teacher-forced with the run's
config (`evaluate.py run.name=<run> checkpoint=<that folder>`, plus the overrides given, e.g. a second corpus's
data keys). Prints walk tau, every-anchor tau and acc@1 per value; each summary.json lands in <run>/eval/<value>/
(evaluate.py keeps an earlier one and writes beside it).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from dflash.drafter.build import SHRINK_KEY
from dflash.drafter.selector_loss import served_weights
from dflash.io import read_json, write_json
from dflash.layout import CheckpointLayout, RunLayout


def shrunk_copy(checkpoint: Path, shrink: float, folder: Path) -> Path:
    """The checkpoint with its servable weights made again from its float32 ones at `shrink`, which its config.json
    records (dflash_config.selector_shrink: a fine-tune from the copy divides it out, dflash.drafter.build)."""
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("train_state"))
    served = load_file(folder / "model.safetensors")
    trained = load_file(CheckpointLayout(checkpoint).state_file(CheckpointLayout.EXACT_WEIGHTS))
    weights = served_weights(trained, shrink)
    save_file({k: v.to(served[k].dtype).contiguous() for k, v in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = read_json(folder / "config.json")
    config["dflash_config"][SHRINK_KEY] = float(shrink)
    write_json(folder / "config.json", config, indent=2)
    return folder


def main(run: str, values: list[str], overrides: list[str]) -> None:
    run_dir = Path(run).resolve()
    checkpoint = RunLayout(run_dir).list_checkpoints()[-1][1]
    for value in values:
        folder = shrunk_copy(checkpoint, float(value), run_dir / "shrink" / value)
        subprocess.run([sys.executable, "evaluate.py", f"run.root={run_dir.parent}", f"run.name={run_dir.name}",
                        f"checkpoint={folder}", "logger=none", *overrides], check=True, capture_output=True)
        newest = max((run_dir / "eval").glob(f"{value}*"), key=lambda p: p.stat().st_mtime)  # an earlier one is kept
        summary = json.loads((newest / "summary.json").read_text())["metrics"]
        print(f"{run_dir.name} shrink {value}: walk tau {summary['eval/tau']:.3f}, every-anchor "
              f"{summary['eval/tau_all_anchors']:.3f}, acc@1 {summary['eval/acc@1']:.3f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], [a for a in args[1:] if "=" not in a], [a for a in args[1:] if "=" in a])
