"""DFlash 2 against DFlash at equal shape, side by side in one process (issue: DFlash 2 drafters).

- a training step (packed forward, the joint loss with the selector's CE, backward, AdamW step) over the same
  blocks, DFlash 2 / DFlash (goal <= 1.10: each convolution's projection adds H x 2kG multiply-adds a token,
  H^2/4 at k=2, G=H/16, about 4% of a layer for two; the selector K x r per slot and two V x r gathers);
- the DFlash 2 step with loss.selector.gradient=coupled (the selector's gradient into the unary logits, added
  sparsely inside the loss's chunks) over the detached one (goal <= 1.10);
- a drafting forward (one block, inference, the target head included), DFlash 2 / DFlash;
- the selector's walk in live decoding (its tables from one batched product and the greedy walk on the host)
  over the DFlash drafting forward (goal < 5%).

Times alternate between the drafters, a few calls each per round, and the medians are compared: both see the
same machine load.
"""

from __future__ import annotations

import copy

import torch

from bench.measure import alternating
from dflash.drafter.blocks import draft_block, draft_packed, pack_blocks, sample_anchors
from dflash.drafter.build import drafter_config
from dflash.drafter.dflash2 import selector_tables, walk_path
from dflash.drafter.loss import block_terms, slot_weights
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.selector_loss import SelectorOptions

SHAPES = {
    # the default (toy) run's drafter: 2 layers, blocks of 16, width 128, vocabulary 2048, the published rank 256,
    # the kind's 32 candidates: codebooks (2 x 2048 x 256) larger than the drafter itself, the worst case for the
    # selector
    "toy": {"hidden": 128, "vocab": 2048, "heads": 1, "head_dim": 128, "layers": 2, "block": 16, "anchors": 256,
            "rank": 256, "top_k": 32},
    # Qwen3-8B's proportions at 1/8 of its width (hidden 4096 -> 512, vocabulary 151936 -> 18992, rank 256 -> 32,
    # MLP 3x, head width 128) with the published DFlash 2 shape (5 layers, blocks of 8, top-16): the selector's
    # share of the parameters (codebooks 2 V r) and of the work is what it is on the real target
    "qwen3_8b_over_8": {"hidden": 512, "vocab": 18992, "heads": 4, "head_dim": 128, "layers": 5, "block": 8,
                        "anchors": 256, "rank": 32, "top_k": 16},
}


def _pair(shape: dict, device):
    """(dflash, dflash2, embed, head) with the same backbone weights."""
    from transformers import Qwen3Config

    h = shape["hidden"]
    tcfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=h, intermediate_size=3 * h, num_hidden_layers=8,
                       num_attention_heads=shape["heads"], num_key_value_heads=max(1, shape["heads"] // 2),
                       head_dim=shape["head_dim"])
    common = dict(num_layers=shape["layers"], block_size=shape["block"], target_layer_ids=[1, 2, 3, 4, 5],
                  mask_token_id=shape["vocab"] - 1)
    torch.manual_seed(0)
    one = DFlashDraftModel(drafter_config(tcfg, **common))
    keys = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": shape["rank"],
            "selector_top_k": shape["top_k"]}
    two = DFlashDraftModel(drafter_config(tcfg, **common, dflash2=keys))
    two.load_state_dict(one.state_dict(), strict=False)
    embed = torch.nn.Embedding(shape["vocab"], h).requires_grad_(False)
    head = torch.nn.Linear(h, shape["vocab"], bias=False).requires_grad_(False)
    return one.to(device), two.to(device), embed.to(device), head.to(device)


def _train_step(drafter, embed, head, feats, blocks, total_w, optimizer, gradient="detach_unary"):
    def step():
        hidden = draft_packed(drafter, embed, feats, blocks)
        terms = block_terms(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, 2**27,
                            selector=drafter.candidate_selector, selector_options=SelectorOptions(gradient))
        loss = terms.loss_sum if terms.selector_sum is None else terms.loss_sum + terms.selector_sum
        (loss / total_w).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def shape_costs(name: str, shape: dict, quick: bool, device) -> dict:
    one, two, embed, head = _pair(shape, device)
    B, n, h = shape["block"], shape["anchors"], shape["hidden"]
    L = n + 2 * B
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"] - 1, (1, L), generator=g)
    feats = torch.randn(1, L, 5 * h, generator=g).to(device)
    mask = torch.ones(1, L, dtype=torch.bool)
    blocks = pack_blocks(ids, mask, torch.tensor([L]), [sample_anchors(mask[0], n, g)], B, shape["vocab"] - 1)
    blocks = blocks.to(device)
    total_w = float((blocks.label_mask * slot_weights(B, 7.0).to(device)).sum())
    coupled = copy.deepcopy(two)  # its own weights and optimizer: the same start as the detached step's
    steps = {k: _train_step(d, embed, head, feats, blocks, total_w, torch.optim.AdamW(d.parameters(), lr=1e-4), g)
             for k, d, g in (("dflash", one, "detach_unary"), ("dflash2", two, "detach_unary"),
                             ("dflash2_coupled", coupled, "coupled"))}
    train = alternating(steps, 2 if quick else 3)
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for k, step in steps.items():  # matmul work, machine-independent (elementwise work is not counted)
        with FlopCounterMode(display=False) as fc:
            step()
        flops[k] = fc.get_total_flops()

    p = L - B  # one block at inference, the whole context before it (no cache: the worst case for the forward)
    anchor = ids[:, p].to(device)
    for d in (one, two):
        d.eval()

    @torch.no_grad()
    def draft(d):
        return head(draft_block(d, embed, feats[:, :p], anchor, p)[:, 1:]).float()

    @torch.no_grad()
    def draft_and_walk():  # what live decoding does with a DFlash 2 block: forward, head, tables, walk
        hidden = draft_block(two, embed, feats[:, :p], anchor, p)[:, 1:]
        logits = head(hidden).float()
        cand, first, table = (t[0] for t in selector_tables(two.candidate_selector, hidden, logits, anchor))
        return walk_path(cand, first, table)

    hidden = draft_block(two, embed, feats[:, :p], anchor, p)[:, 1:].detach()
    logits = head(hidden).float().detach()

    @torch.no_grad()
    def walk_only():
        cand, first, table = (t[0] for t in selector_tables(two.candidate_selector, hidden, logits, anchor))
        return walk_path(cand, first, table)

    infer = alternating({"dflash": lambda: draft(one), "dflash2": lambda: draft(two),
                          "dflash2_with_walk": draft_and_walk, "walk": walk_only}, 3, 10 if quick else 20)
    params = {k: sum(p.numel() for p in d.parameters()) for k, d in (("dflash", one), ("dflash2", two))}
    return {
        "shape": shape, "params": params,
        "train_step_s": {k: round(v, 5) for k, v in train.items()},
        "train_step_ratio": round(train["dflash2"] / train["dflash"], 3),
        "coupled_over_detached": round(train["dflash2_coupled"] / train["dflash2"], 3),
        "train_step_flops": flops, "train_step_flops_ratio": round(flops["dflash2"] / flops["dflash"], 4),
        "draft_forward_s": {k: round(v, 6) for k, v in infer.items()},
        "draft_forward_ratio": round(infer["dflash2"] / infer["dflash"], 3),
        "selector_walk_over_draft_forward": round(infer["walk"] / infer["dflash"], 4),
        "live_block_ratio": round(infer["dflash2_with_walk"] / infer["dflash"], 3),
    }


def dflash2_costs(quick: bool, device, **_) -> dict:
    names = ["toy"] if quick else list(SHAPES)
    return {"shapes": {name: shape_costs(name, SHAPES[name], quick, device) for name in names}}
