"""Run names, run.json, the newest run, progress lines."""

import json
import logging

import pytest

from dflash.errors import NotFoundError
from dflash.layout import RunLayout
from dflash.tracking import Progress, latest_run, record_run


def test_the_newest_run_is_the_newest_with_a_checkpoint(tmp_path):
    old, failed = RunLayout(tmp_path / "old"), RunLayout(tmp_path / "failed")
    for run, created in ((old, "2026-01-01T00:00:00"), (failed, "2026-02-01T00:00:00")):
        run.path.mkdir()
        record_run(run, created=created)
    with pytest.raises(NotFoundError, match="no run .* has a checkpoint yet .*failed, old"):
        latest_run(tmp_path)
    old.checkpoint(10).path.mkdir(parents=True)
    assert latest_run(tmp_path) == old  # not the newer run that failed before its first checkpoint


def test_run_json_is_written_in_one_place_and_keeps_what_it_had(tmp_path):
    run = RunLayout(tmp_path / "r")
    run.path.mkdir()
    first = record_run(run)
    record_run(run, wandb_id="abc")
    info = json.loads(run.info.read_text())
    assert info["wandb_id"] == "abc" and info["created"] == first["created"] and info["name"] == "r"


def test_progress_logs_a_line_when_there_is_no_terminal(caplog, monkeypatch):
    monkeypatch.setattr(Progress, "every_s", 0.0)
    with caplog.at_level(logging.INFO, logger="dflash.tracking"):
        p = Progress(3, "teacher-forced eval", "prompts")
        for _ in range(3):
            p.update()
        p.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.tracking"]
    assert lines and lines[-1].startswith("teacher-forced eval: 3/3 prompts")
