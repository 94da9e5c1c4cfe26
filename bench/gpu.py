"""CUDA-only benchmarks (run by bench/gpu_check.sh): a training step at Qwen3-8B drafter size and
the fla kernels against the PyTorch fallback; each returns {"skipped": ...} on a CPU machine."""

from __future__ import annotations

import torch

from bench.measure import timed
from dflash.drafter.blocks import draft_packed, pack_blocks, sample_anchors
from dflash.drafter.loss import block_loss
from dflash.drafter.model import DFlashDraftModel, drafter_config


def gpu_train_step(quick: bool, device, machine: dict, **_) -> dict:
    """CUDA only: one packed training step at Qwen3-8B drafter dimensions (hidden 4096, 5 layers,
    B=16, vocab 151936) on synthetic features; tokens/s and MFU against the bf16 peak."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    from transformers import Qwen3Config

    torch.manual_seed(0)
    tcfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    drafter = DFlashDraftModel(drafter_config(tcfg, num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                                           mask_token_id=151669)).to(device)
    embed = torch.nn.Embedding(151936, 4096).to(device, torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(4096, 151936, bias=False).to(device, torch.bfloat16).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    out = {}
    for n, L in ((512, 3072),) if quick else ((256, 2048), (512, 3072)):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 150000, (1, L), generator=g)
        mask = torch.ones(1, L, dtype=torch.bool)
        blocks = pack_blocks(ids, mask, torch.tensor([L]), [sample_anchors(mask[0], n, g)], 16, 151669).to(device)
        feats = torch.randn(1, L, 5 * 4096, device=device, dtype=torch.bfloat16)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = draft_packed(drafter, embed, feats, blocks, backend="flex")
                loss, w, _ = block_loss(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, 2**27)
            (loss / w).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        from torch.utils.flop_counter import FlopCounterMode

        step()  # compile flex for this shape
        t = timed(step, repeat=5, warmup=1)
        with FlopCounterMode(display=False) as fc:
            step()
        flops = fc.get_total_flops()
        peak = 989e12  # H100/H200 dense bf16
        out[f"anchors_{n}_len_{L}"] = {"step_s": round(t, 4), "context_tokens_per_s": round(L / t, 1),
                                       "block_tokens_per_s": round(n * 16 / t, 1), "tflops": round(flops / t / 1e12, 1),
                                       "mfu": round(flops / t / peak, 3)}
    return out


def gpu_extraction_kernels(quick: bool, device, **_) -> dict:
    """CUDA only: features of a tiny hybrid target with fla kernels vs the PyTorch fallback."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        return {"skipped": "flash-linear-attention is not installed (pip install 'dflash[gpu]')"}
    import sys

    from transformers import AutoModelForCausalLM

    from dflash.target.builtin import tiny_qwen3_5_config
    from dflash.target.features import target_forward
    from dflash.target.loading import as_target

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_5_config(262), dtype=torch.bfloat16).to(device).eval()
    target = as_target(model)
    ids = torch.randint(0, 256, (8, 1024), device=device)
    fla_t = timed(lambda: target_forward(target, ids, [1, 2, 3, 4, 5]), repeat=5)
    fla_f = target_forward(target, ids, [1, 2, 3, 4, 5]).features.float()
    module = sys.modules[type(next(m for m in model.modules() if "GatedDeltaNet" in type(m).__name__)).__module__]
    saved = {k: getattr(module, k) for k in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    try:  # force the reference PyTorch path on the same weights
        for k, fn in saved.items():
            setattr(module, k, getattr(fn, "__wrapped__", fn))
        ref_t = timed(lambda: target_forward(target, ids, [1, 2, 3, 4, 5]), repeat=5)
        ref_f = target_forward(target, ids, [1, 2, 3, 4, 5]).features.float()
    finally:
        for k, fn in saved.items():
            setattr(module, k, fn)
    diff = (fla_f - ref_f).abs()
    return {"kernels": target.kernels, "fla_s": round(fla_t, 4), "fallback_s": round(ref_t, 4),
            "fallback_over_fla": round(ref_t / fla_t, 2), "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(), "feature_rms": fla_f.pow(2).mean().sqrt().item()}
