"""Hydra multirun sweeps and the local comparison report."""

import json
import os
import subprocess
import sys

import pytest

from dflash.config import ReportConfig
from dflash.report.compare import report
from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    overrides = ["debug=tiny", "logger=wandb_offline", "eval.ddtree_budgets=[4,8]", "eval.plots=true",
                 "train.max_steps=4", "train.save_every=2", "eval.every=2", f"features.dir={tmp}/cache/features",
                 f"run.root={tmp}/runs"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "optim.lr=1e-3,3e-3", "loss.gamma=5,7",
                             *overrides],
                            cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp


def test_multirun_makes_one_run_folder_and_wandb_run_per_job_in_one_group(sweep):
    runs = sorted(p for p in (sweep / "runs").iterdir() if (p / "run.json").exists())
    assert len(runs) == 4
    infos = [json.loads((r / "run.json").read_text()) for r in runs]
    assert len({i["wandb_id"] for i in infos}) == 4
    assert len({i["wandb_group"] for i in infos}) == 1 and infos[0]["wandb_group"] is not None
    # <sweep folder>-<override_dirname>, e.g. 20261130-101500-debug:tiny+...+loss.gamma:5+optim.lr:0.001+...
    swept = {tuple(o for o in r.name.split("+") if o.startswith(("optim.lr:", "loss.gamma:"))) for r in runs}
    assert swept == {(f"loss.gamma:{g}", f"optim.lr:{lr}") for g in (5, 7) for lr in ("0.001", "0.003")}
    for r in runs:
        assert list(r.glob("wandb/offline-run-*")) and (r / "checkpoints/step-000004").is_dir()


def test_report_compares_runs_with_a_plot_per_metric(sweep, capsys):
    runs = sorted(p.name for p in (sweep / "runs").iterdir() if (p / "run.json").exists())
    out = sweep / "report"
    report(ReportConfig(runs=runs, root=str(sweep / "runs"), out=str(out)))
    page = (out / "report.md").read_text()
    assert "optim.lr" in page and "loss.gamma" in page and all(r in page for r in runs)
    for png in ("eval_tau.png", "train_loss.png", "train_tau.png", "acc_per_position.png"):
        assert (out / png).stat().st_size > 1000 and png in page
    summary = json.loads((out / "summary.json").read_text())
    assert [row["final_step"] for row in summary["rows"]] == [4] * 4
    assert all(row["best_tau"] >= 1.0 and row["ddtree@8"] >= 1.0 for row in summary["rows"])
    assert set(summary["differing"]) == {"loss.gamma", "optim.lr"}
    assert sorted(summary["differing"]["optim.lr"].values()) == [0.001, 0.001, 0.003, 0.003]
    assert "| run |" in capsys.readouterr().out
    assert (out / "report.html").exists()


def test_report_cli_takes_the_run_names_of_a_two_key_sweep(sweep):
    """Sweep run names hold several key:value items; the report's runs=[a,b] list must take them as they are."""
    runs = sorted(p.name for p in (sweep / "runs").iterdir() if (p / "run.json").exists())
    out = sweep / "report-cli"
    result = subprocess.run([sys.executable, "-m", "dflash.report", f"runs=[{','.join(runs[:2])}]",
                             f"root={sweep / 'runs'}", f"out={out}"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [row["run"] for row in summary["rows"]] == runs[:2]


def test_a_curve_is_drawn_in_step_order_whatever_the_logging_order():
    """evaluate.py checkpoint=step1000 after training logged step 2000: the held-out tau line went 0 -> 2000 ->
    1000. Points are in step order, a step evaluated again takes its last value, non-numbers are skipped."""
    from dflash.report.compare import curve

    logged = [{"step": 0, "eval/tau": 1.0}, {"step": 2000, "eval/tau": 1.32}, {"step": 50, "train/loss": 9.0},
              {"step": 1000, "eval/tau": 1.29}, {"step": 2000, "eval/tau": 1.33}, {"step": 10, "eval/tau": None}]
    assert curve(logged, "eval/tau") == ([0, 1000, 2000], [1.0, 1.29, 1.33])
    assert curve(logged, "train/loss") == ([50], [9.0]) and curve(logged, "nope") == ([], [])
