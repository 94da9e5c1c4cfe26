"""Errors are for people: one base class, and entry points that print its message, not a traceback.

(evaluate.py's version of the entry-point check is in test_config.py.)
"""

import inspect
import os
import subprocess
import sys

from dflash import errors
from tests.conftest import REPO

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]


def test_every_dflash_error_subclasses_the_base_and_a_builtin_exception():
    assert len(CLASSES) >= 10 and errors.DFlashError in CLASSES
    for cls in CLASSES:
        assert issubclass(cls, errors.DFlashError), cls.__name__
        if cls is not errors.DFlashError:
            # so `except ValueError` (FileNotFoundError, ...) in user code keeps working
            builtin = {b for b in cls.__mro__ if b.__module__ == "builtins"} - {Exception, BaseException, object}
            assert builtin, f"{cls.__name__} derives from no built-in exception but Exception"


def test_report_of_a_missing_run_prints_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-m", "dflash.report", "runs=[nope]", f"root={tmp_path}"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1 and "no run 'nope'" in out and str(tmp_path) in out
    assert list(tmp_path.iterdir()) == []  # nothing written for a report that could not be made


def entry(tmp_path, *args):
    """Run an entry point (train.py, evaluate.py, ...) from `tmp_path`; (exit code, all output)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *(["-m", args[0]] if args[0].startswith("dflash.") else [str(REPO / args[0])]), *args[1:]]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def assert_explained(code_and_out, *needles):
    code, out = code_and_out
    assert code == 2 and "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert all(n in last for n in needles), last


def test_a_required_key_without_a_value_names_the_key(tmp_path):
    assert_explained(entry(tmp_path, "train.py", "experiment=qwen3_8b"), "data.prompts is required")


def test_a_checkpoint_path_that_does_not_exist_is_named(tmp_path):
    assert_explained(entry(tmp_path, "evaluate.py", "checkpoint=./missing", f"run.root={tmp_path}/runs"),
                     "./missing", "does not exist")


def _tiny(tmp_path, *args):
    return ["debug=tiny", f"features.dir={tmp_path}/cache/features", f"run.root={tmp_path}/runs", *args]


def test_empty_and_malformed_prompt_files_are_named(tmp_path):
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text('{"prompt": "fine"}\n{"prompt": "cut\n')
    assert_explained(entry(tmp_path, "extract.py", *_tiny(tmp_path, "data=jsonl", f"data.prompts={empty}")),
                     str(empty), "holds no prompts")
    assert_explained(entry(tmp_path, "train.py", *_tiny(tmp_path, "data=jsonl", f"data.prompts={bad}")),
                     f"{bad}:2 is not valid JSON")


def test_a_corrupt_cache_shard_stops_training_before_the_data_loader(tmp_path):
    assert entry(tmp_path, "extract.py", *_tiny(tmp_path))[0] == 0
    shard = tmp_path / "cache/features/shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    assert_explained(entry(tmp_path, "train.py", *_tiny(tmp_path, "train.num_workers=1", "train.max_steps=2")),
                     str(shard), "does not match its checksum")


def test_a_truncated_drafter_file_names_the_checkpoint(tmp_path, tiny_targets):
    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter

    drafter_dir = tmp_path / "drafter"
    build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(), tiny_targets["tiny_qwen3"]).save_pretrained(
        drafter_dir)
    weights = drafter_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_explained(entry(tmp_path, "evaluate.py", *_tiny(tmp_path, f"checkpoint={drafter_dir}")),
                     str(drafter_dir), "truncated or corrupt")
