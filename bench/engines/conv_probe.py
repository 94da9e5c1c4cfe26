"""DFlash 2's Triton convolution (dflash/drafter/conv_kernel.py) against the torch path, in Triton's interpreter.

    .venv-engines/fla/bin/python -m bench.engines.conv_probe out.json [--break]

Runs in the fla venv (torch and triton; no GPU: TRITON_INTERPRET=1 runs the kernels on CPU tensors, with the
interpreter fixes of pins.py, bfloat16 rounding among them) and writes
the figures bench/engines/conv_check.py judges:
- "ops": for each of SHAPES, the kernel against the torch path by bench.dflash2_conv.compare (forward and the
  three gradients; in bfloat16 both against the float32 torch path) and whether its rule holds.
- "step": a tiny DFlash 2 drafter's packed training step (the convolutions, attention and the selector's loss)
  with the torch path and with `use_conv_kernel(drafter, "auto", cpu)`: the losses and every gradient.
--break: the kernel is handed the whole query row as one block (taps cross the block starts), a boundary bug the
check must catch.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported

import argparse  # noqa: E402
import copy  # noqa: E402

import torch  # noqa: E402

from bench.dflash2_conv import compare, rel  # noqa: E402
from bench.engines import pins  # noqa: E402
from dflash.io import write_json  # noqa: E402

SHAPES = {  # name: (batch, queries, hidden, kernel taps, group size, block length, dtype)
    "packed blocks of 8, k=2 (published)": (2, 32, 64, 2, 16, 8, torch.float32),
    "one partial block (live drafting), k=3": (1, 5, 48, 3, 16, 8, torch.float32),
    "groups of 8 over several tiles, blocks of 6": (2, 48, 256, 4, 8, 6, torch.float32),
    "bfloat16 (autocast), blocks of 8": (2, 32, 64, 2, 16, 8, torch.bfloat16),
}


def _paths(broken: bool):
    from dflash.drafter import conv_kernel, dflash2

    kernel = conv_kernel.grouped_dynamic_conv
    if broken:
        def kernel(z, base, dynamic, group_size, block_len):  # noqa: F811 - the deliberate break
            return conv_kernel.grouped_dynamic_conv(z, base, dynamic, group_size, z.shape[1])
    return dflash2.grouped_dynamic_conv, kernel


def ops(broken: bool) -> dict:
    torch_path, kernel = _paths(broken)
    found = {}
    for i, (label, (b, q, H, k, gs, L, dtype)) in enumerate(SHAPES.items()):
        shape = {"batch": b, "queries": q, "hidden": H, "kernel_size": k, "group_size": gs, "block_len": L}
        found[label] = compare(kernel, torch_path, shape, dtype, torch.device("cpu"), seed=i)
    return found


def step(broken: bool) -> dict:
    """A tiny DFlash 2 drafter's packed step (4 blocks of 8), the torch convolution against the kernel."""
    from transformers import Qwen3Config

    from dflash.drafter import conv_kernel
    from dflash.drafter.blocks import draft_packed, pack_blocks, sample_anchors
    from dflash.drafter.build import drafter_config, use_conv_kernel
    from dflash.drafter.loss import block_terms
    from dflash.drafter.model import DFlashDraftModel

    tcfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    keys = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 8}
    torch.manual_seed(0)
    model = DFlashDraftModel(drafter_config(tcfg, num_layers=2, block_size=8, target_layer_ids=[1, 3, 5],
                                            mask_token_id=299, dflash2=keys))
    with torch.no_grad():  # off the identity init, or the convolutions would pass their input through
        for name, p in model.named_parameters():
            p.add_((0.3 if "conv" in name or "kernel" in name else 0.05) * torch.randn_like(p))
    fused = copy.deepcopy(model)
    chosen = use_conv_kernel(fused, "auto", torch.device("cpu"))
    if broken:
        _, kernel = _paths(True)
        for m in fused.modules():
            if getattr(m, "conv", None) is conv_kernel.grouped_dynamic_conv:
                m.conv = kernel
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 298, (1, 40), generator=g)
    mask = torch.ones(1, 40, dtype=torch.bool)
    blocks = pack_blocks(ids, mask, torch.tensor([40]), [sample_anchors(mask[0], 4, g)], 8, 299)
    embed = torch.nn.Embedding(300, 64).requires_grad_(False)
    head = torch.nn.Linear(64, 300, bias=False).requires_grad_(False)
    feats = torch.randn(1, 40, 3 * 64, generator=g)

    def loss_and_grads(drafter):
        hidden = draft_packed(drafter, embed, feats, blocks)
        terms = block_terms(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, 2**27,
                            selector=drafter.candidate_selector)
        loss = (terms.loss_sum + terms.selector_sum) / terms.weight_sum
        loss.backward()
        return loss.item(), {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}

    loss_t, grads_t = loss_and_grads(model)
    loss_k, grads_k = loss_and_grads(fused)
    worst = max(grads_t, key=lambda n: rel(grads_k[n], grads_t[n]))
    return {"conv_kernel": chosen, "loss_torch": loss_t, "loss_kernel": loss_k,
            "loss_rel_diff": abs(loss_k - loss_t) / abs(loss_t), "grads": len(grads_t),
            "same_grads": sorted(grads_t) == sorted(grads_k),
            "grad_rel_diff": rel(grads_k[worst], grads_t[worst]), "worst_grad": worst}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engines.conv_probe", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON file for the figures")
    parser.add_argument("--break", dest="broken", action="store_true", help="a boundary bug the check must catch")
    args = parser.parse_args()
    pins.apply_interpreter_fixes()  # among them the interpreter's float32 -> bfloat16 cast, which truncated
    import triton

    write_json(args.out, {"triton": triton.__version__, "torch": torch.__version__, "ops": ops(args.broken),
                          "step": step(args.broken)})


if __name__ == "__main__":
    main()
