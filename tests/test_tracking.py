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


def wandb_records(path):
    """The records of an offline W&B run file (`run-<id>.wandb`), parsed with wandb's own protobuf
    classes. wandb >= 0.2x ships no Python reader of the file, so this walks its documented framing:
    the `:W&B` header, then LevelDB-log records (7-byte header: checksum, length, kind) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _read_offline_run(folder):
    recs = wandb_records(next(folder.glob("run-*.wandb")))
    kind = lambda r: r.WhichOneof("record_type")  # noqa: E731
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in recs if kind(r) == "history"]
    return {"runs": [r.run for r in recs if kind(r) == "run"], "history": history,
            "metrics": [r.metric for r in recs if kind(r) == "metric"],
            "artifacts": [r.artifact for r in recs if kind(r) == "artifact"],
            "summary": [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
                        for r in recs if kind(r) == "summary"]}


@pytest.mark.slow
def test_offline_train_and_eval_folders_sync_into_one_run(tmp_path):
    """Evaluation after training writes a second offline folder with the same run id; `wandb sync`
    of both (in order) puts train and eval curves into one run, eval/* against train/step."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    common = ["debug=tiny", "logger=wandb_offline", "run.name=w", f"run.root={tmp_path}/runs",
              f"features.dir={tmp_path}/cache/features"]
    for script, extra in (("train.py", ["train.max_steps=4", "train.save_every=2"]),
                          ("evaluate.py", ["checkpoint=step2"])):
        if script == "evaluate.py":  # a better checkpoint on record: step 2, evaluated last, is worse
            (tmp_path / "runs/w/checkpoints/best.json").write_text(json.dumps({"step": 4, "tau": 5.0}))
        result = subprocess.run([sys.executable, str(REPO / script), *common, *extra], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    run = RunLayout(tmp_path / "runs/w")
    folders = sorted((run.path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2  # train, then eval: sorted by time, the order `wandb sync` needs
    train, evaluation = (_read_offline_run(f) for f in folders)
    wandb_id = json.loads(run.info.read_text())["wandb_id"]
    for part in (train, evaluation):
        assert [(r.run_id, r.project) for r in part["runs"]] == [(wandb_id, "dflash")]
        assert any(m.glob_name == "eval/*" and m.step_metric == "train/step" for m in part["metrics"])
        assert not any(m.name == "eval/tau" and m.summary.max for m in part["metrics"])  # not W&B's own max
    assert any("train/loss" in h for h in train["history"])
    assert [h["train/step"] for h in train["history"] if "eval/tau" in h] == [0, 4]
    assert [h["train/step"] for h in evaluation["history"] if "eval/tau" in h] == [2]
    assert [h["eval/tau"] < 5.0 for h in evaluation["history"] if "eval/tau" in h] == [True]
    # the summary the synced run ends on is the run folder's best, not the worse checkpoint evaluated last
    last = [u for u in evaluation["summary"] if "eval/tau" in u][-1]
    assert (last["eval/tau"], last["eval/best_step"]) == (5.0, 4)
    models = [a for a in train["artifacts"] if a.type == "model"]
    assert len(models) == 2 and all(e.ref.startswith("file://") for a in models for e in a.manifest.contents)


def test_a_progress_line_gives_the_rate_and_the_time_left():
    """In a job's log (no terminal) a long regeneration says how fast it goes and when it ends."""
    from dflash.tracking import Progress

    p = Progress(300, "completions", "prompts")
    p.done = 71
    assert p.line(142.0) == "completions: 71/300 prompts (142 s, 0.5 prompts/s, ETA 7:38)"
    p.done = 0
    assert p.line(3.0).endswith("ETA ?)")
    p.close()


def test_credentials_are_scrubbed_from_a_runs_config_and_the_mask_token_is_not():
    """target.mask_token holds the mask token's text, read back by evaluate.py and checked against the tokenizer:
    scrubbed to <redacted>, a run trained on a preset with one could no longer be evaluated."""
    from dflash.tracking import scrub

    config = {"target": {"mask_token": "<|mask|>", "mask_token_id": 5}, "logger": {"hf_token": "hf_abc", "api_key": "k"},
              "data": {"completions": {"max_new_tokens": 256}}}
    out = scrub(config)
    assert out["target"] == config["target"] and out["data"] == config["data"]
    assert out["logger"] == {"hf_token": "<redacted>", "api_key": "<redacted>"}
