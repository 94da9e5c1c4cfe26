"""Faults a long run meets on a shared cluster: kills, full disks, broken files, untrusted code."""

import errno
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.drafter.build import load_drafter
from dflash.errors import CheckpointError, ProvenanceError
from dflash.layout import RunLayout
from dflash.provenance import GUARDED_FIELDS, check_provenance
from dflash.train import checkpoints as ckpt
from dflash.train.loop import train
from tests.conftest import REPO, compose, tiny_job

FAST = ["debug=tiny"]  # conf/debug/tiny.yaml: tiny target and drafter, short completions


def job(tmp, *overrides):
    return tiny_job("train", tmp, *overrides)


# -- kill and resume ------------------------------------------------------------------------------

SLOW_SAVE = """
import time, torch
_save = torch.save
def _slow_save(*a, **k):
    time.sleep(0.25)  # widen the window in which a checkpoint is being written
    return _save(*a, **k)
torch.save = _slow_save
"""


def assert_all_checkpoints_readable(run: Path) -> None:
    for step, path in RunLayout(run).list_checkpoints():
        ckpt.check_complete(path, need_state=True)
        ckpt.load_train_state(path)
        load_drafter(str(path))
        assert ckpt.checkpoint_step(path) == step


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_gives_the_same_drafter(tmp_path):
    overrides = FAST + [f"features.dir={tmp_path}/cache/features", f"run.root={tmp_path}/runs",
                        "train.max_steps=16", "train.save_every=2", "train.keep_last=2"]
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SLOW_SAVE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(REPO / "train.py"), *overrides]
    # the uninterrupted reference needs no slow saves (nothing kills it): 8 checkpoints of 3 torch.save each
    ref = subprocess.run(cmd + ["run.name=ref"], cwd=tmp_path, env={**os.environ}, capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    rng, run, kills = random.Random(0), tmp_path / "runs" / "cut", 0
    while True:
        resume = ["train.resume=latest"] if RunLayout(run).list_checkpoints() else []
        proc = subprocess.Popen(cmd + ["run.name=cut", *resume], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if kills < 4:
            # wait for a checkpoint write to begin (odd kills) or for training to be under way (even kills)
            target_step = 2 * kills + 4
            deadline = time.time() + 300
            while proc.poll() is None and time.time() < deadline:
                tmp_dirs = list((run / "checkpoints").glob(".tmp-*")) if run.exists() else []
                done = [s for s, _ in RunLayout(run).list_checkpoints()]
                if (kills % 2 and tmp_dirs) or (not kills % 2 and done and max(done) >= target_step):
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.2))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
            proc.wait()
            assert_all_checkpoints_readable(run)
            continue
        err = proc.communicate(timeout=600)[1]
        assert proc.returncode == 0, err[-3000:]
        break
    assert kills == 4
    a = load_file(tmp_path / "runs/ref/checkpoints/step-000016/train_state/weights_fp32.safetensors")
    b = load_file(run / "checkpoints/step-000016/train_state/weights_fp32.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((run / "checkpoints").glob(".tmp-*"))


# -- full disk, broken checkpoints -------------------------------------------------------------------

def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        if "step-000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="disk is full.*previous checkpoint is untouched"):
        train(job(tmp_path, "run.name=full", "train.max_steps=6", "train.save_every=2"))
    run = tmp_path / "runs/full"
    assert [s for s, _ in RunLayout(run).list_checkpoints()] == [2]
    assert_all_checkpoints_readable(run)
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, dflash_home):
    tmp = tmp_path_factory.mktemp("rel")
    return tmp, train(job(tmp, "run.name=ok", "train.max_steps=2", "train.save_every=1", "train.keep_last=5"))


def test_checkpoint_missing_a_file_is_named(finished_run):
    import shutil

    tmp, run = finished_run
    broken = tmp / "runs" / "broken"
    shutil.copytree(run, broken)
    (broken / "checkpoints/step-000002/train_state/optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match="missing train_state/optimizer.bin"):
        train(job(tmp, "run.name=broken", "train.max_steps=4", "train.resume=latest"))
    # a checkpoint of 2 processes needs both processes' RNG states
    state = broken / "checkpoints/step-000001/train_state/state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "world_size": 2}))
    with pytest.raises(CheckpointError, match="missing train_state/random_states_1.pkl"):
        ckpt.check_complete(state.parent.parent, need_state=True)
    (broken / "checkpoints/step-000001/model.safetensors").unlink()
    from dflash.evaluate.runner import evaluate

    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        evaluate(tiny_job("evaluate", tmp, "run.name=broken", "checkpoint=step1"))


@pytest.mark.parametrize("field", GUARDED_FIELDS)
def test_each_provenance_field_is_guarded(field):
    base = {"target": {"fp": "a"}, "tokenizer": "t1", "layer_ids": [1, 2], "dtype": "bfloat16",
            "kernel_backend": "linear_attention=fla"}
    other = {**base, field: "something-else"}
    with pytest.raises(ProvenanceError, match=rf"(?s){field}: .*something-else.*allow_mismatch=\[{field}\]"):
        check_provenance(base, other)


# -- checkpoints of earlier layouts ---------------------------------------------------------------------

def to_format1(checkpoint: Path) -> None:
    """Rewrite train_state/ as dflash wrote it before accelerate's save_state: optimizer.pt, scheduler.pt and
    rng.pt, the main process's (the same content: the optimizer and schedule states, torch's and python's RNG)."""
    from accelerate.utils import load

    state = checkpoint / "train_state"
    for name in ("optimizer", "scheduler"):
        torch.save(load(state / f"{name}.bin"), state / f"{name}.pt")
        (state / f"{name}.bin").unlink()
    rng = load(state / "random_states_0.pkl")
    torch.save({"torch": rng["torch_manual_seed"], "python": rng["random_state"], "cuda": []}, state / "rng.pt")
    (state / "random_states_0.pkl").unlink()
    loop_state = json.loads((state / "state.json").read_text())
    del loop_state["train_state_format"], loop_state["distributed"]
    (state / "state.json").write_text(json.dumps(loop_state))


def test_first_layout_checkpoints_still_resume(finished_run):
    import shutil

    tmp, run = finished_run
    old = tmp / "runs" / "format1"
    shutil.copytree(run, old)
    shutil.rmtree(old / "checkpoints/step-000002")
    to_format1(old / "checkpoints/step-000001")
    train(job(tmp, "run.name=format1", "train.max_steps=2", "train.save_every=1", "train.keep_last=5",
              "train.resume=latest"))
    a, b = (load_file(r / "checkpoints/step-000002/train_state/weights_fp32.safetensors") for r in (run, old))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((old / "checkpoints/step-000002/train_state/state.json").read_text())["train_state_format"] == 2


def test_checkpoints_from_before_dflash2_resume_without_its_module(finished_run):
    """Checkpoints written before DFlash 2 hold modeling_dflash.py but no dflash2.py (nor attention.py, split out of
    the model file later): they still resume (and the checkpoint written next has both)."""
    import shutil

    tmp, run = finished_run
    old = tmp / "runs" / "before-dflash2"
    shutil.copytree(run, old)
    shutil.rmtree(old / "checkpoints/step-000002")
    for name in ("dflash2.py", "attention.py"):
        (old / "checkpoints/step-000001" / name).unlink()
    train(job(tmp, "run.name=before-dflash2", "train.max_steps=2", "train.save_every=1", "train.keep_last=5",
              "train.resume=latest"))
    a, b = (load_file(r / "checkpoints/step-000002/train_state/weights_fp32.safetensors") for r in (run, old))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all((old / "checkpoints/step-000002" / name).exists() for name in ("dflash2.py", "attention.py"))


def test_what_a_checkpoint_cannot_resume_is_refused(finished_run, tmp_path):
    import shutil

    from dflash.errors import ConfigError

    first = {"step": 1, "world_size": 2}  # format 1: no train_state_format, no distributed
    with pytest.raises(ConfigError, match="first train_state/ layout .* resume it with train.distributed=ddp"):
        ckpt.check_resumable(Path("step-000001"), first, "fsdp", 2)
    ckpt.check_resumable(Path("step-000001"), first, "ddp", 2)  # under DDP it resumes
    for written, now in (("ddp", "fsdp"), ("fsdp", "ddp")):
        state = {**first, "train_state_format": 2, "distributed": written}
        with pytest.raises(ConfigError, match=f"written under train.distributed={written} .* with "
                                              f"train.distributed={written}"):
            ckpt.check_resumable(Path("step-000001"), state, now, 2)
    src, run = finished_run
    newer = tmp_path / "newer"
    shutil.copytree(run / "checkpoints/step-000002", newer)
    state = newer / "train_state/state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "train_state_format": 3}))
    with pytest.raises(CheckpointError, match="train_state_format 3, written by a newer dflash"):
        ckpt.load_train_state(newer)


# -- safety -------------------------------------------------------------------------------------------

class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("poisoned", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "optimizer.pt"])
def test_training_state_is_never_unpickled(finished_run, tmp_path, monkeypatch, poisoned):
    import shutil

    src, run = finished_run
    bad = src / "runs" / f"bad-{poisoned}"
    shutil.copytree(run, bad)
    if poisoned.endswith(".pt"):
        to_format1(bad / "checkpoints/step-000002")
    with (bad / "checkpoints/step-000002/train_state" / poisoned).open("wb") as f:
        pickle.dump({"state": _Evil()}, f)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="corrupt"):
        train(job(src, f"run.name={bad.name}", "train.max_steps=3", "train.resume=latest"))
    assert not (tmp_path / "pwned").exists()


def test_every_torch_load_is_weights_only():
    for path in (REPO / "dflash").rglob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"
    weights = [p.suffix for p in (REPO / "dflash").rglob("*") if p.suffix in (".bin", ".pt", ".pkl")]
    assert not weights


def test_remote_code_is_off_unless_asked_for(monkeypatch):
    import transformers

    from dflash.target import load_target

    seen = []

    def capture(*a, **k):
        seen.append(k.get("trust_remote_code"))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", capture)
    for flag, expected in (([], False), (["target.trust_remote_code=true"], True)):
        cfg = compose("train", ["target=qwen3_8b", *flag]).target
        with pytest.raises(FileNotFoundError):
            load_target(cfg, torch.device("cpu"))
        assert seen[-1] is expected


@pytest.mark.slow
def test_wandb_api_key_never_lands_in_the_run_folder(tmp_path):
    secret = "planted-3f9c2a7d41e8b6aa0c5d9e2f7b1a4c8e6d3f0a92"
    env = {**os.environ, "WANDB_API_KEY": secret, "WANDB_MODE": "offline"}
    overrides = FAST + [
        "logger=wandb_offline", f"features.dir={tmp_path}/cache/features", f"run.root={tmp_path}/runs",
        "run.name=secret", "train.max_steps=2"]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "secret"
    assert list(run.glob("wandb/offline-run-*")), "W&B offline files are expected in the run folder"
    scanned = 0
    for f in run.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
            scanned += 1
    assert scanned > 5 and secret not in result.stdout + result.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["wandb_mode"] == "offline" and info["wandb_id"]
