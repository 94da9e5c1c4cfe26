"""CUDA-only tests (marked gpu, run by bench/gpu_check.sh; skipped on CPU machines) and the FLOP formula
the check's MFU figures use. The GPU check itself, run on a CPU machine: tests/bench/gpu/test_checks.py."""

from pathlib import Path

import pytest
import torch

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


@gpu
@needs_cuda
def test_training_batches_arrive_pinned_and_are_upcast_on_cuda():
    """The DataLoader as train() makes it on CUDA (pin_memory=True, a worker): every tensor of a Batch, its
    packed blocks' too, is page-locked, so train_step's non_blocking copies run asynchronously; the bfloat16
    features become float32 on the device, equal to the host's upcast."""
    from types import SimpleNamespace

    from dflash.train.step import batch_features
    from tests.train.test_batches import feature_batch, tensors_of

    dataset = [feature_batch()]
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, pin_memory=True)
    batch = next(iter(loader))
    tensors = tensors_of(batch)
    unpinned = [name for name, t in tensors.items() if not t.is_pinned()]
    assert tensors and not unpinned, unpinned
    acc = SimpleNamespace(device=torch.device("cuda"))
    features = batch_features(acc, None, SimpleNamespace(target_layer_ids=[1, 2]), batch)
    assert batch.features.dtype == torch.bfloat16 and features.dtype == torch.float32 and features.is_cuda
    assert torch.equal(features.cpu(), dataset[0].features.float())


@gpu
@needs_cuda
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_loading_a_target_to_cuda_keeps_host_memory_far_below_the_model(tmp_path):
    """A 520M-parameter target (2.1 GB of float32 files) loaded to CUDA in a fresh process, as bfloat16 (each
    tensor cast on the way) and as float32: the process's own host memory peaks far below the model (a few
    tensors in flight), where filling the model on the host and moving it after held all of it. Pages of
    the mapped files (the shared page cache, RssFile) are reported, not bounded."""
    from tests.target.load_probe import measure, write_target

    params = write_target(tmp_path, hidden=1024, layers=32, vocab=8192)
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        probe = measure(tmp_path, "cuda:0", dtype)
        print(f"load to cuda as {dtype}: peak host RssAnon {probe['peak_anon'] / 2**20:.0f} MiB, RssFile "
              f"{probe['peak_file'] / 2**20:.0f} MiB, model {probe['model_bytes'] / 2**20:.0f} MiB")
        assert probe["devices"] == ["cuda:0"] and probe["model_bytes"] == params * size
        assert probe["peak_anon"] < probe["model_bytes"] / 4, probe


def test_flop_formula_counts_what_the_training_step_multiplies():
    """MFU in the GPU check rests on train_flops: its matmul part equals torch's count on the same step."""
    from torch.utils.flop_counter import FlopCounterMode

    from bench.gpu.steps import SMALL, bf16_peak, loss_and_backward, make_batch, make_drafter, train_flops

    drafter, embed, head = make_drafter(SMALL, torch.device("cpu"), num_layers=2)
    blocks, feats = make_batch(drafter, 300, 16, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        loss_and_backward(drafter, embed.float(), head.weight.float(), feats, blocks, "sdpa", autocast=False)
    # bmm: the CPU path's own-block attention (dflash.drafter.packed_attention), part of the attention term
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "mm" in str(op) and "bmm" not in str(op))
    assert train_flops(drafter, blocks)["matmul"] == pytest.approx(counted, rel=1e-3)
    assert bf16_peak("NVIDIA H200") == 989e12 and bf16_peak("NVIDIA H100 PCIe") == 756e12 and bf16_peak("X") is None
