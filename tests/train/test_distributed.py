"""Several processes (accelerate launch; gloo on a CPU): DDP against one process with the same global
batch, FSDP against DDP, resuming both, and what accelerate and torch do with FSDP on a CPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.errors import ConfigError
from dflash.layout import CheckpointLayout
from tests.conftest import REPO, compose

COMMON = ["debug=tiny", "target=tiny_qwen3_5", "eval.ddtree_budgets=[4,8,16,32]", "eval.plots=true",
          "train.max_steps=6", "train.save_every=100", "noise=gaussian"]


def launch(cwd, procs: int, *overrides, script=REPO / "train.py", common=COMMON, cpu=True):
    """`script` (train.py, or a wrapper given train.py as its first argument) in `procs` processes. Callers
    build the tiny targets first (the tiny_targets fixture): processes that all find one missing build it
    concurrently, and on rank 1 transformers' save_pretrained leaves the model out."""
    if procs == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    if script != REPO / "train.py":
        cmd.append(str(REPO / "train.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"ACCELERATE_USE_CPU": "1"} if cpu else {})}
    result = subprocess.run(cmd + list(common) + list(overrides), cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def losses(run):
    return [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in line]


@pytest.mark.slow
def two_processes_match_one(tmp_path, *overrides: str) -> tuple[Path, Path]:
    """Launch 2 processes of batch 1 and 1 process of batch 2 (grad_accum 2: global batch 4 either way) and
    check that their 6 losses and final float32 weights agree within 1e-5; returns (one, two) run folders."""
    launch(tmp_path, 2, "train.batch_size=1", "train.grad_accum=2", "run.name=two", *overrides)
    launch(tmp_path, 1, "train.batch_size=2", "train.grad_accum=2", "run.name=one", *overrides)
    one, two = tmp_path / "runs/one", tmp_path / "runs/two"
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa = load_file(one / "checkpoints/step-000006/train_state/weights_fp32.safetensors")
    wb = load_file(two / "checkpoints/step-000006/train_state/weights_fp32.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    return one, two


def test_two_processes_match_one_with_the_same_global_batch(tmp_path, tiny_targets):
    _, two = two_processes_match_one(tmp_path)
    assert json.loads((two / "checkpoints/step-000006/train_state/state.json").read_text())["world_size"] == 2


@pytest.mark.slow
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


# -- FSDP ------------------------------------------------------------------------------------------------

FACTS = """
import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from dflash.train.accel import fsdp_plugin

acc = Accelerator(fsdp_plugin=fsdp_plugin(), cpu=True)
lines = [f"accelerate: {acc.distributed_type}"]
try:
    FullyShardedDataParallel(torch.nn.Linear(4, 4))
except RuntimeError as e:
    lines.append(f"fsdp1: {e}")
layer = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (acc.num_processes,)))
lines.append(f"fsdp2: {type(layer.weight).__name__} {tuple(layer.weight.to_local().shape)}")
with open(f"facts-{acc.process_index}.txt", "w") as f:  # one file a process: their stdout interleaves
    f.write("\\n".join(lines))
acc.end_training()  # the group ended before exit (left to it, gloo's threads can abort a process)
"""

FSDP_ON_CPU = """
# train.py (argv[1]) with accelerate's FSDP switched on by hand: accelerate makes DDP of FSDP on a CPU
# (see test_fsdp_on_a_cpu_facts), while torch's FSDP2, which accelerate uses, runs on gloo
import runpy
import sys

from dflash.train import accel, loop


def make_accelerator(train):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    assert train.distributed == "fsdp"
    plugin = accel.fsdp_plugin()
    acc = Accelerator(mixed_precision="no", fsdp_plugin=plugin, cpu=True, step_scheduler_with_optimizer=False)
    assert acc.distributed_type == DistributedType.MULTI_CPU
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


loop.make_accelerator = make_accelerator  # what train() calls
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# the same global batch (1 sequence x 2 processes x 2 micro-batches) for DDP and FSDP
SAME = ["debug=tiny", "noise=gaussian", "train.max_steps=6", "train.save_every=3", "train.keep_last=5",
        "train.batch_size=1", "train.grad_accum=2"]


def weights(run, step=6):
    return load_file(run / f"checkpoints/step-{step:06d}/train_state/weights_fp32.safetensors")


@pytest.mark.slow
def test_fsdp_on_a_cpu_facts(tmp_path):
    """accelerate 1.15 drops the FSDP plugin on a CPU (MULTI_CPU: DDP), torch's FSDP1 refuses a CPU, FSDP2
    shards on gloo: hence the refusal below, and FSDP_ON_CPU for testing the FSDP path here."""
    (tmp_path / "facts.py").write_text(FACTS)
    launch(tmp_path, 2, script=tmp_path / "facts.py", common=[])
    for rank in (0, 1):
        lines = (tmp_path / f"facts-{rank}.txt").read_text().splitlines()
        assert lines[0] == "accelerate: DistributedType.MULTI_CPU"
        assert lines[1].startswith("fsdp1: FSDP needs a non-CPU accelerator device")
        assert lines[2] == "fsdp2: DTensor (2, 4)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fsdp_is_refused_on_a_cpu_before_any_work(tmp_path):
    from dflash.train.loop import train

    job = compose("train", ["debug=tiny", f"features.dir={tmp_path}/cache", f"run.root={tmp_path}/runs",
                            "train.distributed=fsdp"])
    with pytest.raises(ConfigError, match=r"train.distributed=fsdp needs CUDA devices: accelerate .* use "
                                          r"train.distributed=ddp here"):
        train(job)
    assert not list(tmp_path.iterdir())  # no run folder, no features


@pytest.fixture(scope="module")
def ddp_and_fsdp(tmp_path_factory, tiny_targets):
    """The same 6 steps under DDP and (FSDP_ON_CPU) FSDP, 2 processes each, checkpoints at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("fsdp")
    (tmp / "fsdp_on_cpu.py").write_text(FSDP_ON_CPU)
    launch(tmp, 2, "run.name=ddp", common=SAME)
    launch(tmp, 2, "run.name=fsdp", "train.distributed=fsdp", script=tmp / "fsdp_on_cpu.py", common=SAME)
    return tmp


@pytest.mark.slow
def test_fsdp_trains_and_evaluates_as_ddp_with_the_same_global_batch(ddp_and_fsdp):
    ddp, fsdp = ddp_and_fsdp / "runs/ddp", ddp_and_fsdp / "runs/fsdp"
    a, b = losses(ddp), losses(fsdp)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa, wb = weights(ddp), weights(fsdp)
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    # the held-out evaluation ran on the full parameters (gathered from the shards), at step 0 and at the end
    for step in ("step-000000", "step-000006"):
        ea, eb = (json.loads((run / "eval" / step / "summary.json").read_text())["metrics"] for run in (ddp, fsdp))
        assert ea.keys() == eb.keys() and all(abs(ea[k] - eb[k]) < 1e-6 for k in ea), (ea, eb)
        ba, bb = ([json.loads(line) for line in (run / "eval" / step / "blocks.jsonl").read_text().splitlines()]
                  for run in (ddp, fsdp))
        assert len(ba) == len(bb) and sum(x["all_anchors"] for x in ba) == ea["eval/blocks_all_anchors"]
        assert all(x["topk_ids"] == y["topk_ids"] for x, y in zip(ba, bb))
        logprobs = [torch.tensor([x["topk_logprobs"] for x in blocks]) for blocks in (ba, bb)]
        assert (logprobs[0] - logprobs[1]).abs().max() < 1e-5
    for run, fsdp_files in ((ddp, False), (fsdp, True)):
        ck = CheckpointLayout(run / "checkpoints/step-000006")
        assert {str(p.relative_to(ck.path)) for p in ck.path.rglob("*") if p.is_file()} == ck.files(
            world_size=2, fsdp=fsdp_files)
        state = json.loads(ck.state.read_text())
        assert (state["distributed"], state["world_size"]) == ("fsdp" if fsdp_files else "ddp", 2)
    assert not list((fsdp / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_resume_gives_the_uninterrupted_run(ddp_and_fsdp, mode):
    """Interrupted after step 3: the optimizer, schedule and each process's RNG come back through accelerate's
    load_state (under FSDP into the shards), and steps 4-6 are the uninterrupted run's, bit for bit."""
    full, cut = ddp_and_fsdp / "runs" / mode, ddp_and_fsdp / "runs" / f"{mode}-cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints/step-000006")
    (cut / "metrics.jsonl").write_text("".join(line for line in (full / "metrics.jsonl").read_text().splitlines(True)
                                               if json.loads(line)["step"] <= 3))
    extra = {"ddp": {}, "fsdp": {"script": ddp_and_fsdp / "fsdp_on_cpu.py"}}[mode]
    launch(ddp_and_fsdp, 2, f"run.name={mode}-cut", f"train.distributed={mode}", "train.resume=latest",
           common=SAME, **extra)
    a, b = weights(full), weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(cut) == losses(full)


COUNT_REDUCTIONS = """
# train.py under FSDP_ON_CPU (fsdp_on_cpu.py next to this file), counting each optimizer step's collectives:
# FSDP2 reduces each shard group's gradients with torch.distributed.reduce_scatter_single, accelerate's reduce
# is torch.distributed.all_reduce. One JSON list a process, a record a step.
import json
import runpy
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from dflash.train import loop

calls = {"reduce_scatter": 0, "all_reduce": 0}


def counted(name, collective):
    def call(*args, **kwargs):
        calls[name] += 1
        return collective(*args, **kwargs)
    return call


dist.reduce_scatter_single = counted("reduce_scatter", dist.reduce_scatter_single)
dist.all_reduce = counted("all_reduce", dist.all_reduce)
steps, train_step = [], loop.train_step


def counting_step(job, acc, m, target, micro, *args):
    before = dict(calls)
    train_step(job, acc, m, target, micro, *args)
    groups = sum(isinstance(module, FSDPModule) for module in m.model.modules())
    steps.append({"micro": len(micro), "groups": groups, **{k: calls[k] - before[k] for k in calls}})
    Path(f"steps-{acc.process_index}.json").write_text(json.dumps(steps))


loop.train_step = counting_step
sys.argv = [str(Path(__file__).with_name("fsdp_on_cpu.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_fsdp_gradient_accumulation_reduces_once_per_step(tmp_path, tiny_targets):
    """grad_accum=4 under FSDP2 (FSDP_ON_CPU): micro-batches 1-3 run forward and backward inside no_sync (FSDP2
    reads the flag in backward), so a step reduce-scatters each shard group's gradients once, not four times;
    its other collectives are the global weight sum and the non-finite flag. The weights are those of one
    process with the same global batch (8 sequences a step) and no accumulation."""
    (tmp_path / "fsdp_on_cpu.py").write_text(FSDP_ON_CPU)
    (tmp_path / "count.py").write_text(COUNT_REDUCTIONS)
    common = ["debug=tiny", "noise=gaussian", "train.max_steps=4", "train.save_every=100", "eval.at_start=false",
              "eval.max_prompts=1"]
    launch(tmp_path, 2, "run.name=fsdp", "train.distributed=fsdp", "train.batch_size=1", "train.grad_accum=4",
           script=tmp_path / "count.py", common=common)
    launch(tmp_path, 1, "run.name=one", "train.batch_size=8", common=common)
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"steps-{rank}.json").read_text())
        assert len(steps) == 4 and steps[0]["groups"] >= 2, steps
        assert all(s == {"micro": 4, "groups": s["groups"], "reduce_scatter": s["groups"], "all_reduce": 2}
                   for s in steps), steps
    one, fsdp = tmp_path / "runs/one", tmp_path / "runs/fsdp"
    a, b = losses(one), losses(fsdp)
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa, wb = weights(one, 4), weights(fsdp, 4)
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (FSDP shards across processes)")
def test_fsdp_on_cuda_trains_as_ddp_and_resumes(tmp_path, tiny_targets):
    gpus = torch.cuda.device_count()
    same = [*SAME, "train.mixed_precision=no", "train.attention=sdpa"]
    launch(tmp_path, gpus, "run.name=ddp", common=same, cpu=False)
    launch(tmp_path, gpus, "run.name=fsdp", "train.distributed=fsdp", common=same, cpu=False)
    ddp, fsdp = tmp_path / "runs/ddp", tmp_path / "runs/fsdp"
    a, b = losses(ddp), losses(fsdp)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    wa, wb = weights(ddp), weights(fsdp)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    assert json.loads((fsdp / "checkpoints/step-000006/train_state/state.json").read_text())["distributed"] == "fsdp"
    shutil.rmtree(fsdp / "checkpoints/step-000006")
    launch(tmp_path, gpus, "run.name=fsdp", "train.distributed=fsdp", "train.resume=latest", common=same, cpu=False)
    resumed = weights(fsdp)
    assert all(torch.equal(wb[k], resumed[k]) for k in wb)


# -- waits longer than the collective timeout ---------------------------------------------------------------

LATE = """
# train.py (argv[1]) with process 0 late by LATE_S seconds in completions, in extraction (once each) and in every
# in-run evaluation; each late start is recorded in late-0.txt, with the process group's timeout
import os
import runpy
import sys
import time

import torch

from dflash.data import completions, extraction
from dflash.evaluate import runner

late = float(os.environ["LATE_S"])


def delayed(module, name, every_call):
    original, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        if os.environ["RANK"] == "0" and (every_call or not calls):
            group = torch.distributed.distributed_c10d._get_default_group()
            timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            with open("late-0.txt", "a") as f:
                f.write(f"{name} {timeout:g}\\n")
            time.sleep(late)
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


delayed(completions, "_run_hf", every_call=False)
delayed(extraction, "batched_features", every_call=False)
delayed(runner, "evaluate_in_run", every_call=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_process_late_past_the_collective_timeout_in_completions_extraction_and_evaluation(tmp_path, tiny_targets,
                                                                                             monkeypatch):
    """A 3 s collective timeout (train.collective_timeout_minutes=0.05) and process 0 4.5 s late in generating
    completions, in extracting features and in both in-run evaluations: process 1's waits do not time out
    (tests/test_dist.py shows that a plain barrier would), and the run completes."""
    (tmp_path / "late.py").write_text(LATE)
    monkeypatch.setenv("LATE_S", "4.5")  # 1.5 s past the timeout, four times over
    launch(tmp_path, 2, "train.collective_timeout_minutes=0.05", "train.max_steps=2", "run.name=late",
           script=tmp_path / "late.py")
    assert (tmp_path / "late-0.txt").read_text().splitlines() == [
        "_run_hf 3", "batched_features 3", "evaluate_in_run 3", "evaluate_in_run 3"]
    run = tmp_path / "runs/late"
    assert len(losses(run)) == 2
    assert (run / "eval/step-000000/summary.json").exists() and (run / "eval/step-000002/summary.json").exists()
    assert (run / "checkpoints/step-000002/model.safetensors").exists()


@pytest.mark.slow
def test_dflash2_trains_alike_on_one_process_under_ddp_and_under_fsdp(tmp_path, tiny_targets):
    """The selector's loss is computed outside the drafter's forward (beside the target's head): its codebooks'
    and projection's gradients must still be reduced across processes, under DDP and FSDP2 (whose root unit holds
    them) alike: 2 DDP processes = 1 process, and FSDP = DDP, in losses and in every float32 weight."""
    (tmp_path / "fsdp_on_cpu.py").write_text(FSDP_ON_CPU)
    d2 = ("drafter.kind=dflash2", "drafter.selector_rank=16")
    _, ddp = two_processes_match_one(tmp_path, *d2)
    launch(tmp_path, 2, "train.batch_size=1", "train.grad_accum=2", "run.name=fsdp", "train.distributed=fsdp", *d2,
           script=tmp_path / "fsdp_on_cpu.py")
    fsdp = tmp_path / "runs/fsdp"
    a, b = losses(ddp), losses(fsdp)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa, wb = weights(ddp), weights(fsdp)
    assert any("candidate_selector" in k for k in wa) and wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
