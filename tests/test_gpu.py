"""CUDA-only tests (marked gpu, run by bench/gpu_check.sh; skipped on CPU machines), and the GPU
check itself run on a CPU machine (its GPU checks SKIP there, the others run small)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
def test_flex_block_mask_equals_the_dense_path_on_cuda():
    from dflash.drafter.blocks import draft_packed, pack_blocks
    from tests.drafter.test_model import make_drafter

    drafter = make_drafter(["sliding_attention", "full_attention"], 6).cuda()
    embed = torch.nn.Embedding(300, 64).cuda()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 290, (2, 300), generator=g)
    feats = torch.randn(2, 300, 192, generator=g).cuda()
    mask = torch.ones(2, 300, dtype=torch.bool)
    anchors = [torch.arange(3, 280, 5), torch.arange(7, 250, 9)]
    blocks = pack_blocks(ids, mask, torch.tensor([300, 300]), anchors, 8, 299).to("cuda")
    with torch.no_grad():
        dense = draft_packed(drafter, embed, feats, blocks, "sdpa")
        flex = draft_packed(drafter, embed, feats, blocks, "flex")
    assert (dense - flex).abs().max() < 1e-4


@gpu
@needs_cuda
def test_hybrid_target_on_fallback_kernels_is_refused_on_cuda(dflash_home):
    import importlib.util

    from dflash.target.loading import load_target
    from tests.conftest import compose

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed: the fallback is not what transformers binds")
    cfg = compose("train", ["target=tiny_qwen3_5", "target.device=cuda"]).target
    with pytest.raises(RuntimeError, match="allow_fallback_kernels"):
        load_target(cfg)
    assert load_target(compose("train", ["target=tiny_qwen3_5", "target.device=cuda",
                                         "target.allow_fallback_kernels=true"]).target).is_hybrid


@gpu
@needs_cuda
def test_bf16_training_step_on_cuda(tmp_path):
    from dflash.train.loop import train
    from tests.conftest import compose

    run = train(compose("train", [
        "debug=tiny", "eval.ddtree_budgets=[4,8,16,32]", "eval.plots=true", "train.num_anchors=32",
        "train.log_every=10", "train.max_steps=4", "target.dtype=bfloat16", f"features.dir={tmp_path}/cache/features",
        f"run.root={tmp_path}/runs", "run.name=gpu"]))
    assert (run / "checkpoints/step-000004/model.safetensors").exists()


def test_flop_formula_counts_what_the_training_step_multiplies():
    """MFU in the GPU check rests on train_flops: its matmul part equals torch's count on the same step."""
    from torch.utils.flop_counter import FlopCounterMode

    from bench.gpu import SMALL, bf16_peak, loss_and_backward, make_batch, make_drafter, train_flops

    drafter, embed, head = make_drafter(SMALL, torch.device("cpu"), num_layers=2)
    blocks, feats = make_batch(drafter, 300, 16, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        loss_and_backward(drafter, embed.float(), head.weight.float(), feats, blocks, "sdpa", autocast=False)
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert train_flops(drafter, blocks)["matmul"] == pytest.approx(counted, rel=1e-3)
    assert bf16_peak("NVIDIA H200") == 989e12 and bf16_peak("NVIDIA H100 PCIe") == 756e12 and bf16_peak("X") is None


@pytest.mark.slow
def test_gpu_check_runs_on_a_cpu_machine_and_says_what_it_skipped(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the check takes minutes: run bash bench/gpu_check.sh")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, GPU_CHECK_RESULTS=str(tmp_path), OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("flex_train_step", "gpu_tests", "fla_kernels"):
        assert any(line.startswith(f"SKIP {name} needs CUDA") for line in lines), run.stdout
    for name in ("install", "autocast_loss", "live_lossless"):
        assert any(line.startswith(f"PASS {name} ") for line in lines), run.stdout
    [path] = tmp_path.glob("*-gpu-check.json")
    report = json.loads(path.read_text())
    assert report["summary"] == {"PASS": 3, "FAIL": 0, "SKIP": 3}
    assert report["checks"]["live_lossless"]["runs"] and report["checks"]["autocast_loss"]["loss_rel_diff"] < 1e-2
