"""Hydra multirun sweeps and the local comparison report."""

import json
import os
import subprocess
import sys

import pytest

from dflash.config import ReportConfig
from dflash.evaluate.report import report
from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    overrides = ["debug=tiny", "logger=wandb_offline", "eval.ddtree_budgets=[4,8]", "eval.plots=true",
                 "train.max_steps=4", "train.save_every=2", "eval.every=2", f"features.dir={tmp}/cache/features",
                 f"run.root={tmp}/runs"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "optim.lr=1e-3,3e-3", *overrides],
                            cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp


def test_multirun_makes_one_run_folder_and_wandb_run_per_job_in_one_group(sweep):
    runs = sorted(p for p in (sweep / "runs").iterdir() if (p / "run.json").exists())
    assert len(runs) == 2
    infos = [json.loads((r / "run.json").read_text()) for r in runs]
    assert infos[0]["wandb_id"] != infos[1]["wandb_id"]
    assert infos[0]["wandb_group"] == infos[1]["wandb_group"] is not None
    # <sweep folder>-<override_dirname>, e.g. 20261130-101500-debug=tiny,...,optim.lr=0.001,train.max_steps=4
    assert {o for r in runs for o in r.name.split(",") if o.startswith("optim.lr=")} == {
        "optim.lr=0.001", "optim.lr=0.003"}
    for r in runs:
        assert list(r.glob("wandb/offline-run-*")) and (r / "checkpoints/step-000004").is_dir()


def test_report_compares_runs_with_a_plot_per_metric(sweep, capsys):
    runs = sorted(p.name for p in (sweep / "runs").iterdir() if (p / "run.json").exists())
    out = sweep / "report"
    report(ReportConfig(runs=runs, root=str(sweep / "runs"), out=str(out)))
    page = (out / "report.md").read_text()
    assert "optim.lr" in page and all(r in page for r in runs)
    for png in ("eval_tau.png", "train_loss.png", "train_tau.png", "acc_per_position.png"):
        assert (out / png).stat().st_size > 1000 and png in page
    summary = json.loads((out / "summary.json").read_text())
    assert [row["final_step"] for row in summary["rows"]] == [4, 4]
    assert all(row["best_tau"] >= 1.0 and row["ddtree@8"] >= row["best_tau"] for row in summary["rows"])
    assert summary["differing"] == {"optim.lr": {runs[0]: 0.001, runs[1]: 0.003}}
    assert "| run |" in capsys.readouterr().out
    assert (out / "report.html").exists()
