"""CUDA-only checks (run by bench/gpu_check.sh); skipped on CPU machines."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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


def test_bf16_training_step_on_cuda(tmp_path):
    from dflash.train.loop import train
    from tests.conftest import compose

    run = train(compose("train", [
        "debug=tiny", "eval.ddtree_budgets=[4,8,16,32]", "eval.plots=true", "train.num_anchors=32",
        "train.log_every=10", "train.max_steps=4", "target.dtype=bfloat16", f"features.dir={tmp_path}/cache/features",
        f"run.root={tmp_path}/runs", "run.name=gpu"]))
    assert (run / "checkpoints/step-000004/model.safetensors").exists()
