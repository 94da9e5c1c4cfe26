"""Two CPU processes (gloo, accelerate launch) against one process with the same global batch."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO

pytestmark = pytest.mark.slow

COMMON = ["debug=tiny", "target=tiny_qwen3_5", "eval.ddtree_budgets=[4,8,16,32]", "eval.plots=true",
          "train.max_steps=6", "train.save_every=100", "noise=gaussian"]


def launch(cwd, procs: int, *overrides):
    if procs == 1:
        cmd = [sys.executable, str(REPO / "train.py")]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train.py")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd + COMMON + list(overrides), cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def losses(run):
    return [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in line]


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    launch(tmp_path, 2, "train.batch_size=1", "train.grad_accum=2", "run.name=two")  # global batch 4
    launch(tmp_path, 1, "train.batch_size=2", "train.grad_accum=2", "run.name=one")
    one, two = tmp_path / "runs/one", tmp_path / "runs/two"
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa = load_file(one / "checkpoints/step-000006/train_state/weights_fp32.safetensors")
    wb = load_file(two / "checkpoints/step-000006/train_state/weights_fp32.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    assert json.loads((two / "checkpoints/step-000006/train_state/state.json").read_text())["world_size"] == 2


def test_two_process_extraction_writes_the_same_cache(tmp_path):
    def extract(procs, name):
        cmd = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if procs == 2
               else [sys.executable])
        overrides = ["target=tiny_qwen3_5", "data=tiny", "data.completions.max_new_tokens=24",
                     "features.shard_sequences=3", f"features.dir={tmp_path}/{name}",
                     # one set of completions for both (the 1-process run generates them), so the
                     # comparison is about splitting the extraction, not about batched generation
                     f"data.completions.path={tmp_path}/completions.jsonl"]
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd + [str(REPO / "extract.py")] + overrides, cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        if procs == 2:  # each process took its own share of the shards
            assert "process 0 of 2 extracts shards [0, 2, 4]" in r.stdout + r.stderr
            assert "process 1 of 2 extracts shards [1, 3, 5]" in r.stdout + r.stderr
        return json.loads((tmp_path / name / "manifest.json").read_text())

    one, two = extract(1, "one"), extract(2, "two")
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    assert len(one["shards"]) == 6
    for f in ("target", "tokenizer", "layer_ids", "kernel_backend", "data"):
        assert one[f] == two[f]
