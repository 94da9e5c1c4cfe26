"""GPU measurements. bench/gpu_checks.py turns them into the PASS/FAIL lines of bench/gpu_check.sh;
`gpu_train_step` and `gpu_extraction_kernels` are also `python -m bench` suites.

- `flex_lengths`: the compiled flex training step at Qwen3-8B drafter size over several context
  lengths: tokens/s, MFU against the GPU's bf16 peak, peak memory, and how many flex graphs compiled.
- `autocast_gap`: one batch through bf16 autocast and through float32, same weights and features.
- `extraction_kernels`: a tiny hybrid target's features with the fla kernels and with the PyTorch
  fallback, both against a float32 reference.
- `live_lossless`: speculative decoding checked token for token against plain decoding.
"""

from __future__ import annotations

import logging
import tempfile
import time

import torch

from bench.measure import timed
from bench.plan import TARGETS
from dflash.drafter.blocks import draft_packed, pack_blocks, sample_anchors
from dflash.drafter.loss import block_loss
from dflash.drafter.model import DFlashDraftModel, drafter_config

# Qwen3-8B (the target, as the memory plan holds its published config) and a small stand-in of the same
# shape for CPU smoke runs
QWEN3_8B = TARGETS["qwen3_8b"][1]
SMALL = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
BLOCK, GAMMA, CHUNK_LOGITS = 16, 7.0, 2**27  # the recipe: B=16, gamma 7, loss.chunk_logits default

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device-name substring; first match wins.
PEAK_BF16_TFLOPS = (("H200 NVL", 835), ("H200", 989), ("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989),
                    ("H800", 989), ("GH200", 989), ("B200", 2250), ("A100", 312), ("L40S", 362))


def bf16_peak(device_name: str) -> float | None:
    """FLOP/s of the GPU's dense bf16 peak, or None for a GPU not in the table."""
    return next((t * 1e12 for key, t in PEAK_BF16_TFLOPS if key in device_name), None)


def make_drafter(dims: dict, device, num_layers: int = 5):
    """A drafter of `dims` (target dims: hidden, heads, vocab) in float32 on `device`, and the frozen
    embedding / LM head a target lends it, in bf16 (as a bf16 target holds them)."""
    from transformers import Qwen3Config

    from dflash.target.layer_ids import build_target_layer_ids

    tcfg = Qwen3Config(**dims)
    ids = build_target_layer_ids(dims["num_hidden_layers"], num_layers)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: a 1B-parameter init on the host takes minutes
        drafter = DFlashDraftModel(drafter_config(tcfg, num_layers=num_layers, block_size=BLOCK, target_layer_ids=ids,
                                                  mask_token_id=dims["vocab_size"] - 1)).float()
        embed = torch.nn.Embedding(dims["vocab_size"], dims["hidden_size"]).to(torch.bfloat16).requires_grad_(False)
        head = torch.nn.Linear(dims["hidden_size"], dims["vocab_size"], bias=False).to(torch.bfloat16)
    return drafter, embed, head.requires_grad_(False)


def make_batch(drafter, length: int, num_anchors: int, device, seed: int = 0):
    """One sequence of `length` tokens, all response, `num_anchors` blocks, and float32 features that
    are exactly bf16 values (so a bf16 and a float32 run see the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    vocab, width = drafter.config.vocab_size, drafter.fc.in_features
    ids = torch.randint(0, vocab - 2, (1, length), generator=g)
    mask = torch.ones(1, length, dtype=torch.bool)
    blocks = pack_blocks(ids, mask, torch.tensor([length]), [sample_anchors(mask[0], num_anchors, g)],
                         drafter.block_size, drafter.mask_token_id).to(device)
    feats = torch.randn(1, length, width, generator=g).to(torch.bfloat16).float().to(device)
    return blocks, feats


def loss_and_backward(drafter, embed, head_weight, feats, blocks, backend: str, autocast: bool) -> float:
    """The training step's forward and backward (as dflash.train.loop.train_step, with num_anchors
    blocks per sequence as the padded block count); returns the loss."""
    with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft_packed(drafter, embed, feats, blocks, backend, num_blocks=blocks.anchors.shape[1])
        loss_sum, weight, _ = block_loss(hidden, head_weight, blocks.labels, blocks.label_mask, GAMMA, CHUNK_LOGITS)
    loss = loss_sum / weight
    loss.backward()
    return loss.item()


def train_flops(drafter, blocks) -> dict:
    """Model FLOPs of one training step of a full-attention drafter, padding excluded: 2 per
    multiply-add; backward twice the forward for trained weights, once for frozen ones (fc passes no
    gradient to the features, the LM head none to its weight); attention over the visible
    (query, key) pairs only. {"matmul": ..., "attention": ...}."""
    c, B = drafter.config, drafter.block_size
    H, hd, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    b, n = blocks.anchors.shape
    L, Q = blocks.ctx_len * b, n * B * b
    per_layer = 2 * Q * H * nh * hd * 2 + 2 * (L + Q) * H * nkv * hd * 2 + 2 * Q * H * c.intermediate_size * 3
    fc = 2 * L * drafter.fc.in_features * H
    head = 2 * float(blocks.label_mask.sum()) * H * c.vocab_size
    pairs = float((blocks.anchors.float() + B)[blocks.valid].sum()) * B  # a block sees anchor + B keys
    return {"matmul": 3 * len(drafter.layers) * per_layer + 2 * fc + 2 * head,
            "attention": 3 * len(drafter.layers) * 4 * pairs * hd * nh}


class RecompileWatch(logging.Handler):
    """Collects dynamo's 'hit config.recompile_limit' warnings (past the limit a function runs
    uncompiled: for flex attention, a dense reference path)."""

    LOGGERS = ("torch._dynamo", "torch._dynamo.convert_frame")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []
        self._last = None

    def emit(self, record):
        msg = record.getMessage()
        limit = any(k in msg for k in ("recompile_limit", "cache_size_limit", "recompile limit"))
        if limit and record is not self._last:
            self.hits.append(msg.splitlines()[0])
        self._last = record  # seen by both loggers when it propagates

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        return False


def compile_counts() -> dict:
    """Flex graphs compiled so far in this process: dflash's own count (once the model exposes it)
    and dynamo's count of unique graphs (the drafter compiles nothing else here)."""
    from torch._dynamo.utils import counters

    import dflash.drafter.model as model_module

    own = getattr(model_module, "flex_compile_count", None)
    return {"flex_compile_count": own() if own is not None else None,
            "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"])}


def flex_lengths(lengths: list[int], num_anchors: int, budget_s: float, device, dims: dict = QWEN3_8B,
                 repeat: int = 3, on_length=None) -> dict:
    """The compiled flex training step (AdamW included) at each context length, in order, until
    `budget_s` would be exceeded. Per length: step time, tokens/s, TFLOP/s, MFU, peak memory, the
    first step's time (compile included) and the compile counts after it."""
    drafter, embed, head = make_drafter(dims, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    peak = bf16_peak(torch.cuda.get_device_name(device))
    start, out = time.time(), {"lengths": {}, "gpu_bf16_peak_tflops": peak and peak / 1e12}
    with RecompileWatch() as watch:
        for i, L in enumerate(lengths):
            spent = time.time() - start
            last = max((r["first_step_s"] + repeat * r["step_s"] for r in out["lengths"].values()), default=0.0)
            if i and spent + 1.5 * last > budget_s:
                out["stopped"] = f"time budget: {spent:.0f} s of {budget_s:.0f} spent, {L} would not fit"
                break
            blocks, feats = make_batch(drafter, L, num_anchors, device, seed=L)

            def step(feats=feats, blocks=blocks):
                loss_and_backward(drafter, embed, head.weight, feats, blocks, "flex", autocast=True)
                opt.step()
                opt.zero_grad(set_to_none=True)

            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()  # compiles flex for this shape (or reuses a bucket's graph)
            torch.cuda.synchronize(device)
            first = time.perf_counter() - t0
            t = timed(step, repeat=repeat, warmup=0)
            flops = sum(train_flops(drafter, blocks).values())
            out["lengths"][L] = {
                "step_s": round(t, 4), "first_step_s": round(first, 2),
                "context_tokens_per_s": round(L / t, 1), "block_tokens_per_s": round(blocks.input_ids.numel() / t, 1),
                "tflops": round(flops / t / 1e12, 1), "mfu": round(flops / t / peak, 3) if peak else None,
                "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2), **compile_counts()}
            if on_length is not None:
                on_length(out)
    out["recompile_limit_hits"] = watch.hits
    out["compiles"] = compile_counts()
    out["shape"] = (f"drafter 5 layers at Qwen3-8B size (hidden 4096, vocab 151936), B={BLOCK}, {num_anchors} "
                    f"anchors, bf16 autocast, AdamW; MFU = model FLOPs (visible attention pairs only) / bf16 peak")
    return out


def autocast_gap(device, dims: dict, length: int, num_anchors: int, backend: str) -> dict:
    """The same batch, same weights, through bf16 autocast and through float32: losses and gradients."""
    if device.type == "cuda":  # the float32 run is the reference: no TF32 in it
        torch.backends.cuda.matmul.allow_tf32 = False
    drafter, embed, head = make_drafter(dims, device)
    # bf16 values held in float32, so both runs have identical weights; the head scaled 4x spreads the
    # logits (std ~2 instead of ~0.6: nearer a trained model's) so the loss responds to the hidden states
    embed, head_w = embed.float(), (head.weight.float() * 4).to(torch.bfloat16).float()
    blocks, feats = make_batch(drafter, length, num_anchors, device)
    runs = {}
    for name, autocast in (("float32", False), ("bf16_autocast", True)):
        drafter.zero_grad(set_to_none=True)
        loss = loss_and_backward(drafter, embed, head_w, feats, blocks, backend, autocast)
        runs[name] = (loss, torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None]))
    (l32, g32), (l16, g16) = runs["float32"], runs["bf16_autocast"]
    return {"loss_float32": l32, "loss_bf16_autocast": l16, "loss_rel_diff": abs(l16 - l32) / abs(l32),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(g16.double(), g32.double(), dim=0)),
            "grad_norm_ratio": float(g16.norm() / g32.norm()), "backend": backend,
            "shape": f"hidden {dims['hidden_size']}, vocab {dims['vocab_size']}, 5 layers, length {length}, "
                     f"{num_anchors} anchors, B={BLOCK}"}


def _gated_deltanet_outputs(model, ids, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [b, L, 5 x H], every Gated DeltaNet module's output concatenated [b, L, 6 x H]), float32.
    The modules' own outputs show a kernel's error: in a random-weight model their gated output is a
    small part of the residual stream, so a wrong kernel would hardly move the features."""
    from dflash.target.features import target_forward
    from dflash.target.loading import as_target

    outs = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append((o[0] if isinstance(o, tuple) else o).float()))
             for m in model.modules() if "GatedDeltaNet" in type(m).__name__]
    try:
        features = target_forward(as_target(model), ids, layers).features.float()
    finally:
        for h in hooks:
            h.remove()
    return features, torch.cat(outs, -1)


def extraction_kernels(device, batch: int = 8, length: int = 1024) -> dict:
    """A tiny hybrid target (6 Gated DeltaNet + 2 attention layers, hidden 64) on [batch, length]
    tokens, in bf16 with the kernels transformers bound (fla on a CUDA machine that has it) and with
    the PyTorch fallback on the same weights, each compared with the fallback in float32 (the
    reference) at the Gated DeltaNet outputs and at the features; and the time of each."""
    import sys

    from transformers import AutoModelForCausalLM

    from dflash.target.builtin import tiny_qwen3_5_config
    from dflash.target.features import target_forward
    from dflash.target.loading import as_target

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_5_config(262), dtype=torch.bfloat16).to(device).eval()
    target = as_target(model)
    layers = [1, 2, 3, 4, 5]
    ids = torch.randint(0, 256, (batch, length), device=device)
    runs = {"bound": (timed(lambda: target_forward(target, ids, layers), repeat=5),
                      *_gated_deltanet_outputs(model, ids, layers))}
    linear = next(m for m in model.modules() if "GatedDeltaNet" in type(m).__name__)
    module = sys.modules[type(linear).__module__]
    saved = {k: getattr(module, k) for k in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    try:  # the reference PyTorch code on the same weights: the functions transformers wrapped
        for k, fn in saved.items():
            setattr(module, k, getattr(fn, "__wrapped__", fn))
        runs["fallback"] = (timed(lambda: target_forward(target, ids, layers), repeat=5),
                            *_gated_deltanet_outputs(model, ids, layers))
        runs["reference"] = (None, *_gated_deltanet_outputs(model.float(), ids, layers))
    finally:
        for k, fn in saved.items():
            setattr(module, k, fn)
    out = {"kernels": target.kernels, "bound_s": round(runs["bound"][0], 4),
           "fallback_s": round(runs["fallback"][0], 4),
           "fallback_over_bound": round(runs["fallback"][0] / runs["bound"][0], 2)}
    for i, what in ((1, "features"), (2, "deltanet")):
        ref = runs["reference"][i]
        out[f"{what}_rms"] = ref.pow(2).mean().sqrt().item()
        out[f"{what}_max_abs_diff"] = (runs["bound"][i] - runs["fallback"][i]).abs().max().item()
        for name in ("bound", "fallback"):
            err = (runs[name][i] - ref).abs()
            out[f"{what}_{name}_err_mean"], out[f"{what}_{name}_err_max"] = err.mean().item(), err.max().item()
    return out


def live_lossless(device, dtypes=("float32", "bfloat16"), prompts: int = 2, new_tokens: int = 48) -> dict:
    """Speculative decoding against plain greedy decoding, token for token, on the toy target (a
    trained hybrid: path verification with linear-state rollback) and the tiny Qwen3 (attention only:
    path and DDTree verification), with a drafter that knows the answer but misses on purpose (so
    blocks are partly accepted) and a random real drafter. Divergences follow the project's rule
    (dflash.evaluate.live.check_lossless, eval.tie_margin null): at a top-2 logit margin under the
    tie margin they are counted as ties, otherwise a LosslessError is raised."""
    import os

    from dflash.config import DrafterConfig, LayersConfig, TargetConfig
    from dflash.data.prompts import encode, load_prompts, prompt_text
    from dflash.drafter.build import build_drafter
    from dflash.evaluate.decode import greedy_generate, speculative_generate
    from dflash.evaluate.live import check_lossless
    from dflash.target.loading import load_target
    from tests.oracle import OracleDrafter

    tmp = None if os.environ.get("DFLASH_HOME") else tempfile.TemporaryDirectory(prefix="dflash-gpu-check-")
    home = os.environ.get("DFLASH_HOME") or tmp.name

    def miss(p: int, k: int) -> bool:  # one deliberate miss per 7 slots: blocks partly accepted
        return (p + k) % 7 == 0

    out = {"runs": [], "tie_margin": {"float32": 1e-3, "bfloat16": 0.1}, "new_tokens": new_tokens}
    for name, mask in (("toy", 5), ("tiny_qwen3", 261)):
        for dtype in dtypes:
            target = load_target(TargetConfig(name=name, path=f"{home}/targets/{name}", build=name, mask_token_id=mask,
                                              dtype=dtype, device=str(device), allow_fallback_kernels=True), device)
            tie = out["tie_margin"][dtype]
            torch.manual_seed(0)
            real = build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(num=3), target)
            real = real.to(device, target.dtype).eval()
            for prompt in load_prompts("builtin:eval_coding", limit=prompts):
                text = prompt_text(target.tokenizer, prompt, True, False)
                ids = torch.tensor([encode(target.tokenizer, text)], device=device)
                plain = greedy_generate(target, ids, new_tokens)[0].tolist()
                oracle = OracleDrafter(target, plain, block_size=8, wrong=miss).to(device).eval()
                budgets = [None] if target.is_hybrid else [None, 8]
                for kind, drafter in (("oracle", oracle), ("random", real)):
                    for budget in budgets:
                        res = speculative_generate(drafter, target, ids, new_tokens, tree_budget=budget)
                        same = check_lossless(target, prompt.id, plain, res.output_ids[0].tolist(), ids.shape[1], tie)
                        taus = res.acceptance_lengths
                        out["runs"].append({"target": name, "kernels": target.kernels, "dtype": dtype,
                                            "prompt": prompt.id, "drafter": kind, "tree_budget": budget,
                                            "identical": same, "tau": round(sum(taus) / len(taus), 3),
                                            "replays": res.replays})
    if tmp is not None:
        tmp.cleanup()
    return out


# `python -m bench` suites (a table row each; bench/gpu_check.sh runs the checks above instead)

def gpu_train_step(quick: bool, device, **_) -> dict:
    """CUDA only: the compiled flex training step at Qwen3-8B drafter size over several lengths."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    return flex_lengths([3072] if quick else [1024, 2048, 3072, 4096], 512, 600, device)


def gpu_extraction_kernels(quick: bool, device, **_) -> dict:
    """CUDA only: features of a tiny hybrid target with fla kernels vs the PyTorch fallback."""
    import importlib.util

    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    if importlib.util.find_spec("fla") is None:
        return {"skipped": "flash-linear-attention is not installed (pip install 'dflash[gpu]')"}
    return extraction_kernels(device)
