"""The default run's loss curve, pinned: `python train.py` (toy target, toy data, every default
setting) on its first GOLDEN_PROMPTS prompts must log the training loss of the golden file at
each of its steps, within a tolerance (as torchtitan checks its loss curves). A change to the
toy target, the data path, the block construction, the loss or the optimizer moves the curve
and fails here, even when the run still "learns".

After an intended change, rewrite the golden file and commit it with the change:

    DFLASH_UPDATE_GOLDEN=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled pytest tests/train/test_golden_curve.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from dflash.train.loop import train
from tests.conftest import compose

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden" / "default_loss_curve.json"
GOLDEN_PROMPTS = 24
STEPS = 40
LOG_EVERY = 5
REL_TOL = 0.02  # CPU float32: thread count and kernel choice move the last digits, not 2%


def curve_run(tmp: Path) -> dict[int, float]:
    run = train(compose("train", [
        f"data.limit={GOLDEN_PROMPTS}", f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}",
        "logger=none", "eval.at_start=false", "eval.max_prompts=1", "eval.max_new_tokens=32", "eval.plots=false",
        "train.num_workers=0", "train.save_every=100000", f"features.dir={tmp}/cache/toy/features",
        f"run.root={tmp}/runs", "run.name=golden"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_default_run_follows_the_golden_loss_curve(tmp_path):
    curve = curve_run(tmp_path)
    assert len(curve) == STEPS // LOG_EVERY, curve
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"prompts": GOLDEN_PROMPTS, "steps": STEPS, "torch": torch.__version__,
                                      "loss": {str(k): round(v, 5) for k, v in sorted(curve.items())}}, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    golden = {int(k): v for k, v in json.loads(GOLDEN.read_text())["loss"].items()}
    assert sorted(curve) == sorted(golden)
    off = {s: (round(curve[s], 5), golden[s]) for s in golden if abs(curve[s] - golden[s]) > REL_TOL * abs(golden[s])}
    assert not off, f"loss (now, golden) off by more than {REL_TOL:.0%} at steps {off}; see this file's docstring"
    # and the curve is a learning one: the loss falls over the steps
    assert curve[max(curve)] < curve[min(curve)]
