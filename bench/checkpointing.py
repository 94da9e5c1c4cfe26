"""train.gradient_checkpointing's three modes side by side: the training step's time and its peak tensor memory.

    python -m bench --only checkpointing

One drafter at the Qwen3-8B drafter's proportions, shrunk (hidden 256, MLP 3x, 8 query heads of 32 over 2 key-value
heads, 2 layers, blocks of 16), 256 blocks over a 1024-token context, the packed sdpa path and the head's loss over a
2048-token vocabulary, in float32 (on a CPU; bf16 autocast on CUDA). Timed in alternation (bench.measure.alternating):
the step's forward and backward with no checkpointing, selective (dflash.drafter.recompute) and full. Each mode's
peak tensor memory is measured once (bench.measure.TensorPeak, on any device; tests/plan/test_plan.py holds the memory
plan to such measurements).
"""

from __future__ import annotations

import torch

from bench.measure import TensorPeak, alternating
from dflash.drafter.blocks import draft_packed, pack_blocks
from dflash.drafter.build import drafter_config
from dflash.drafter.loss import block_terms
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.recompute import MODES, use_checkpointing

SHAPE = {"hidden": 256, "heads": 8, "kv_heads": 2, "layers": 2, "block": 16, "ctx": 1024, "anchors": 256,
         "vocab": 2048}
QUICK = {**SHAPE, "ctx": 512, "anchors": 64}


def checkpointing_costs(quick: bool, device, **_) -> dict:
    from transformers import Qwen3Config

    s = QUICK if quick else SHAPE
    H, V, L, n = s["hidden"], s["vocab"], s["ctx"], s["anchors"]
    torch.manual_seed(0)
    target = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=8,
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=H // s["heads"])
    drafter = DFlashDraftModel(drafter_config(target, num_layers=s["layers"], block_size=s["block"],
                                              target_layer_ids=[1, 3, 5], mask_token_id=V - 1)).to(device).train()
    embed = torch.nn.Embedding(V, H).to(device).requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).to(device).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (1, L), generator=g)
    anchors = torch.linspace(0, L - 2, n).round().long()
    blocks = pack_blocks(ids, torch.ones(1, L, dtype=torch.bool), torch.tensor([L]), [anchors], s["block"],
                         V - 1).to(device)
    features = torch.randn(1, L, 3 * H, generator=g).to(device)
    autocast = device.type == "cuda"
    losses = {}

    def step(mode):
        def run():
            use_checkpointing(drafter, mode)
            drafter.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                hidden = draft_packed(drafter, embed, features, blocks, "sdpa")
                terms = block_terms(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, 0)
            (terms.loss_sum / terms.weight_sum).backward()
            losses[mode] = terms.loss_sum.item()
        return run

    arms = {m: step(m) for m in MODES}
    times = alternating(arms, 2 if quick else 4)
    peaks = {}
    for mode in MODES:
        step(mode)()  # the gradients exist from here on, as in training's later steps
        with TensorPeak() as mem:
            mem.track(*drafter.parameters(), *[p.grad for p in drafter.parameters()], *drafter.buffers(),
                      embed.weight, head.weight, features, ids,
                      *[v for v in vars(blocks).values() if torch.is_tensor(v)])
            step(mode)()
        peaks[mode] = round(mem.peak / 2**20, 2)
    off = times["off"]
    return {"shape": s, "step_s": {k: round(v, 4) for k, v in times.items()}, "peak_mib": peaks,
            "same_loss": len(set(losses.values())) == 1,
            "selective_step_over_off": round(times["selective"] / off, 3),
            "full_step_over_off": round(times["full"] / off, 3),
            "selective_step_over_full": round(times["selective"] / times["full"], 3),
            "selective_peak_over_off": round(peaks["selective"] / peaks["off"], 3),
            "full_peak_over_off": round(peaks["full"] / peaks["off"], 3)}
