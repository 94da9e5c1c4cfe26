"""GPU measurements of the drafter's training step. bench/gpu/checks.py turns them into the PASS/FAIL
lines of bench/gpu_check.sh; `gpu_train_step` and `gpu_extraction_kernels` are also `python -m bench`
suites. (The target side, kernels and live decoding, is bench/gpu/target.py.)

- `flex_lengths`: the compiled flex training step at Qwen3-8B drafter size over several context
  lengths: tokens/s, MFU against the GPU's bf16 peak, peak memory, and what dynamo compiled per length.
- `preset_step`: one experiment preset's training step at its configured shape (the Qwen3.6-27B
  drafter at 3072 tokens and 512 anchors), its peak memory next to the plan's estimate.
- `autocast_gap`: one batch through bf16 autocast and through float32, same weights and features.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from bench.measure import TensorPeak, timed
from dflash.drafter.blocks import draft_packed, pack_blocks, sample_anchors
from dflash.drafter.build import drafter_config
from dflash.drafter.loss import block_terms
from dflash.drafter.model import DFlashDraftModel
from dflash.plan.flops import train_flops
from dflash.plan.targets import TARGETS
from dflash.tiling import flex_padded_shape

# Qwen3-8B (the target, as the memory plan holds its published config) and a small stand-in of the same
# shape for CPU smoke runs
QWEN3_8B = TARGETS["qwen3_8b"][1]
SMALL = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
BLOCK, GAMMA, CHUNK_LOGITS = 16, 7.0, 2**27  # the recipe: B=16, gamma 7, loss.chunk_logits default
# the recipe's 3072 tokens (the presets train at 32768: these checks keep the shape their recorded results were
# measured at) and the presets' 512 anchors
QWEN3_6_PRESET = ["experiment=qwen3_6_27b", "train.mode=offline", "data.max_length=3072"]
QWEN3_6_DFLASH2_PRESET = ["experiment=qwen3_6_27b_dflash2", "train.mode=offline", "data.max_length=3072"]  # DFlash 2

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device-name substring; first match wins.
PEAK_BF16_TFLOPS = (("H200 NVL", 835), ("H200", 989), ("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989),
                    ("H800", 989), ("GH200", 989), ("B200", 2250), ("A100", 312), ("L40S", 362))


def bf16_peak(device_name: str) -> float | None:
    """FLOP/s of the GPU's dense bf16 peak, or None for a GPU not in the table."""
    return next((t * 1e12 for key, t in PEAK_BF16_TFLOPS if key in device_name), None)


def _device_peak(device) -> float | None:
    return bf16_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def make_batch(drafter, length: int, num_anchors: int, device, seed: int = 0, spread: bool = False):
    """One sequence of `length` tokens, all response, `num_anchors` blocks (sampled, or with `spread`
    evenly over the sequence, as the plan assumes), and float32 features that are exactly bf16 values
    (so a bf16 and a float32 run see the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    vocab, width = drafter.config.vocab_size, drafter.fc.in_features
    ids = torch.randint(0, vocab - 2, (1, length), generator=g)
    mask = torch.ones(1, length, dtype=torch.bool)
    anchors = torch.linspace(0, length - 2, num_anchors).round().long() if spread else \
        sample_anchors(mask[0], num_anchors, g)
    blocks = pack_blocks(ids, mask, torch.tensor([length]), [anchors], drafter.block_size,
                         drafter.mask_token_id).to(device)
    feats = torch.randn(1, length, width, generator=g).to(torch.bfloat16).float().to(device)
    return blocks, feats


def loss_and_backward(drafter, embed, head_weight, feats, blocks, backend: str, autocast: bool,
                      gamma: float = GAMMA, chunk_logits: int = CHUNK_LOGITS) -> float:
    """The training step's forward and backward (as dflash.train.step.train_step, with num_anchors
    blocks per sequence as the padded block count); returns the loss."""
    with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft_packed(drafter, embed, feats, blocks, backend, num_blocks=blocks.anchors.shape[1])
        terms = block_terms(hidden, head_weight, blocks.labels, blocks.label_mask, gamma, chunk_logits,
                            selector=drafter.candidate_selector)  # DFlash 2: its selector's CE too
    loss = (terms.loss_sum + (0 if terms.selector_sum is None else terms.selector_sum)) / terms.weight_sum
    loss.backward()
    return loss.item()


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (its own count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileWatch(logging.Handler):
    """What dynamo compiles while active, by its own records: graphs (counters["stats"]["unique_graphs"]),
    recompiles (its "Recompiling function" records, from the recompiles log this turns on: a guard of
    every graph so far failed, so a new one was compiled) with their reasons, and hits of the recompile
    limit (past it a function runs uncompiled: flex attention then materialises every score).
    `mark()` gives the counts so far; two marks' difference is what the steps between them compiled."""

    LIMIT_LOGGERS = ("torch._dynamo", "torch._dynamo.convert_frame")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []
        self.hits: list[str] = []
        self._last = None

    def emit(self, record):
        if record is self._last:  # seen again as it propagates to a parent logger
            return
        self._last = record
        msg = record.getMessage()
        if msg.startswith("Recompiling function"):
            self.recompiles.append(" | ".join(ln.strip() for ln in msg.splitlines()[:4]))
        elif record.levelno >= logging.WARNING and any(
                k in msg for k in ("recompile_limit", "cache_size_limit", "recompile limit")):
            self.hits.append(msg.splitlines()[0])

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        self._loggers = [logging.getLogger(n) for n in self.LIMIT_LOGGERS]
        self._loggers.append(torch._logging.getArtifactLogger("torch._dynamo.guards", "recompiles"))
        for logger in self._loggers:
            logger.addHandler(self)
        self._start = dynamo_graphs()
        return self

    def __exit__(self, *exc):
        for logger in self._loggers:
            logger.removeHandler(self)
        torch._logging.set_logs()
        return False

    def mark(self) -> dict:
        return {"graphs": dynamo_graphs() - self._start, "recompiles": len(self.recompiles),
                "limit_hits": len(self.hits)}


def _compiled_between(a: dict, b: dict) -> dict:
    return {"graphs": b["graphs"] - a["graphs"], "recompiles": b["recompiles"] - a["recompiles"]}


def next_cost(length: int, compiled: bool, measured: dict, repeat: int) -> float:
    """Projected seconds to measure `length`: its first step (a compile when its padded shape is new,
    projected from the last new-shape compile measured, a warm one once there is one: the first, cold
    compile is paid once) or a plain step when the shape is compiled, then `repeat` timed steps (the
    measured step times scaled to this length, the largest). measured: length -> its record."""
    if not measured:
        return 0.0
    step = max(r["step_s"] * length / L for L, r in measured.items())
    if compiled:
        return (1 + repeat) * step
    last_new = [r for r in measured.values() if r["new_shape"]][-1]
    return last_new["first_step_s"] + repeat * step


def flex_lengths(lengths: list[int], num_anchors: int, budget_s: float, device, dims: dict = QWEN3_8B,
                 repeat: int = 3, on_length=None, backend: str = "flex") -> dict:
    """The compiled flex training step (AdamW included) at each context length in order; a length whose
    projected time (`next_cost`) exceeds what is left of `budget_s` is skipped and the next ones are
    still tried (a length of a compiled shape costs no compile). Per length: step time, tokens/s,
    TFLOP/s, MFU, peak memory, the first step's time, and dynamo's graphs and recompiles in the first
    step and in the timed steps after it. on_length(out) after each length (partial results)."""
    from dflash.drafter import attention

    drafter, embed, head = make_drafter(dims, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    peak = _device_peak(device)
    start, compiled = time.time(), set()
    out = {"lengths": {}, "skipped": {}, "gpu_bf16_peak_tflops": peak and peak / 1e12}
    with CompileWatch() as watch:
        for L in lengths:
            shape = flex_padded_shape(L, num_anchors, num_anchors)
            cost, left = next_cost(L, shape in compiled, out["lengths"], repeat), budget_s - (time.time() - start)
            if out["lengths"] and cost > left:
                out["skipped"][L] = f"projected {cost:.0f} s, {left:.0f} s of {budget_s:.0f} left"
                continue
            blocks, feats = make_batch(drafter, L, num_anchors, device, seed=L)

            def step(feats=feats, blocks=blocks):
                loss_and_backward(drafter, embed, head.weight, feats, blocks, backend, autocast=True)
                opt.step()
                opt.zero_grad(set_to_none=True)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            before = watch.mark()
            _sync(device)
            t0 = time.perf_counter()
            step()  # compiles flex for a new padded shape; reuses the graph of a compiled one
            _sync(device)
            first, after_first = time.perf_counter() - t0, watch.mark()
            t = timed(step, repeat=repeat, warmup=0)
            flops = sum(train_flops(drafter, blocks).values())
            out["lengths"][L] = {
                "step_s": round(t, 4), "first_step_s": round(first, 2), "padded_shape": list(shape),
                "new_shape": shape not in compiled, "first_step_compiled": _compiled_between(before, after_first),
                "timed_steps_compiled": _compiled_between(after_first, watch.mark()),
                "context_tokens_per_s": round(L / t, 1), "block_tokens_per_s": round(blocks.input_ids.numel() / t, 1),
                "tflops": round(flops / t / 1e12, 1), "mfu": round(flops / t / peak, 3) if peak else None,
                "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                if device.type == "cuda" else None}
            compiled.add(shape)
            if on_length is not None:
                on_length(out)
        out["recompile_limit_hits"] = watch.hits
        out["recompile_reasons"] = watch.recompiles[:10]
        out["compiles"] = {"dynamo_graphs": watch.mark()["graphs"], "dynamo_recompiles": len(watch.recompiles),
                           "flex_compile_count": attention.flex_compile_count()}
    out["shape"] = (f"drafter 5 layers at {dims['hidden_size']} hidden, vocab {dims['vocab_size']}, B={BLOCK}, "
                    f"{num_anchors} anchors, bf16 autocast, AdamW, {backend} attention; MFU = model FLOPs (visible "
                    f"attention pairs only) / bf16 peak")
    return out


def preset_job(overrides: list[str]):
    """(job, Shape, Setup) of the plan (dflash.plan) for an experiment preset: the config groups train.py composes,
    and the shape and step the plan estimates, for one sequence (batch 1, no accumulation, no
    allowance or fragmentation: what the allocator counts)."""
    from dflash.plan.compose import compose
    from dflash.plan.report import build

    job = compose(overrides)
    _, shape, setup = build(job)
    return job, shape, replace(setup, batch=1, grad_accum=1, world=1, allowance=0.0, fragmentation=0.0)


def preset_drafter(job: dict, device):
    """The preset's drafter (build_drafter, float32) and the frozen embed_tokens / lm_head of its target
    in target.dtype, random, made on `device`."""
    from torch import nn

    from dflash.drafter.build import build_drafter
    from dflash.plan.configured import target_config
    from dflash.target.loading import DTYPES, Target

    text, dtype = target_config(job["target"]), DTYPES[job["target"].dtype]
    H, V = text.hidden_size, text.vocab_size
    torch.manual_seed(0)
    with torch.device(device):
        embed = nn.Embedding(V, H, dtype=dtype).requires_grad_(False)
        head = nn.Linear(H, V, bias=False, dtype=dtype).requires_grad_(False)
        target = Target(model=None, tokenizer=None, config=text, layers=None, final_norm=None, embed_tokens=embed,
                        lm_head=head, mask_token_id=job["target"].mask_token_id, path=job["target"].path)
        drafter = build_drafter(job["drafter"], job["layers"], target)
    return drafter, embed, head


def preset_step(device, overrides: list[str] = QWEN3_6_PRESET, repeat: int = 3, budget_s: float | None = None) -> dict:
    """One training step of an experiment preset at its configured shape (data.max_length tokens, all
    response, train.num_anchors blocks spread evenly; bf16 autocast unless train.mixed_precision=no;
    flex unless train.attention=sdpa; clipping and AdamW as training runs them): time of the first
    step (compiles), median of `repeat` more, tokens/s, MFU, dynamo's graphs and recompiles, and the
    peak tensor memory of a step (CUDA: max_memory_allocated over the timed steps; CPU: TensorPeak), and of
    one more forward and backward alone (no optimizer step), each next to the plan's for the same shape. Last,
    one more step under torch.profiler (bench.gpu.profile: time by op class, top kernels) unless what is left
    of `budget_s` (seconds from the call) is below `profile_cost`: then "profile" says it was skipped."""
    from dflash.config import OptimConfig
    from dflash.drafter.build import use_conv_kernel
    from dflash.drafter.recompute import use_checkpointing
    from dflash.plan import memory
    from dflash.train.batches import add_noise
    from dflash.train.optim import build_optimizer

    called = time.time()
    job, shape, setup = preset_job(overrides)
    optim = OptimConfig()  # the training default: AdamW fused on CUDA (optim.fused=auto), no foreach temporary
    setup = replace(setup, foreach=False)
    drafter, embed, head = preset_drafter(job, device)
    use_checkpointing(drafter, memory.MODE_WORDS[setup.checkpointing])  # as dflash.train.loop turns it on
    conv_kernel = use_conv_kernel(drafter, job["train"].conv_kernel, device)  # DFlash 2: Triton on CUDA, as it trains
    drafter.train()
    L, n = setup.ctx_len, setup.num_anchors
    blocks, clean = make_batch(drafter, L, n, device, spread=True)
    feats = add_noise(clean, job["noise"], len(drafter.target_layer_ids), 0, 0, [0])
    opt = build_optimizer(drafter, optim)
    gamma, autocast = job["loss"].gamma_for(drafter.block_size), setup.compute == 2

    def backward():  # the forward and backward, before the optimizer step
        loss_and_backward(drafter, embed, head.weight, feats, blocks, setup.backend, autocast, gamma,
                          job["loss"].chunk_logits)

    def step():
        backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def held() -> list:  # on CPU, the tensors made before a step, which TensorPeak counts only when told
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return [*drafter.parameters(), *drafter.buffers(), embed.weight, head.weight, clean, feats, *state,
                *[v for v in vars(blocks).values() if torch.is_tensor(v)]]

    with CompileWatch() as watch:
        _sync(device)
        t0 = time.perf_counter()
        step()  # compiles one flex graph per mask kind; makes AdamW's state
        _sync(device)
        first, after_first = time.perf_counter() - t0, watch.mark()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            t = timed(step, repeat=repeat, warmup=0)
            measured, start = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            backward()
            _sync(device)
            window = torch.cuda.max_memory_allocated(device)
        else:
            t = timed(step, repeat=1, warmup=0)
            with TensorPeak() as mem:
                mem.track(*held())
                step()
            with TensorPeak() as part:
                part.track(*held())
                start = part.live
                backward()
            measured, window = mem.peak, part.peak
        opt.zero_grad(set_to_none=True)  # no optimizer step on the gradients of that one
        timed_compiled = _compiled_between(after_first, watch.mark())
    need, left = profile_cost(t), (budget_s - (time.time() - called)) if budget_s is not None else float("inf")
    if left < need:
        profile = {"skipped": f"{left:.0f} s of the {budget_s:.0f} s budget left, a profiled step needs about "
                              f"{need:.0f} s"}
    else:
        from bench.gpu.profile import profile_step

        try:  # the profile says where the time went; it never fails the check
            profile = profile_step(step, device)
        except Exception as e:  # noqa: BLE001 - e.g. a profiler without CUPTI
            profile = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        opt.zero_grad(set_to_none=True)
    estimate, phase = memory.peak(shape, setup)
    # the forward and backward alone, whose peak the activations set: the whole step's is the optimizer's
    window_plan, window_phase = memory.peak(shape, setup, memory.BACKWARD)
    rise_plan = window_plan - sum(memory.terms(shape, setup)[k] for k in memory.PERSISTENT)
    flops, peak = sum(train_flops(drafter, blocks).values()), _device_peak(device)
    types = ", ".join(f"{k} x{drafter.layer_types.count(k)}" for k in dict.fromkeys(drafter.layer_types))
    c = drafter.config
    return {
        "shape": f"{' '.join(overrides)}: drafter {len(drafter.layers)} layers ({types}, window {c.sliding_window}), "
                 f"heads {c.num_attention_heads}/{c.num_key_value_heads} x {c.head_dim}, hidden {c.hidden_size}, "
                 f"vocab {c.vocab_size}, B={drafter.block_size}, {L} tokens, {n} anchors, {setup.backend}, "
                 f"{'bf16 autocast' if autocast else 'float32'}",
        "backend": setup.backend, "checkpointing": setup.checkpointing,  # the plan: is the recompute in the MFU
        "conv_kernel": conv_kernel,
        "params": sum(p.numel() for p in drafter.parameters()),
        "mask_kinds": len(set(drafter.layer_types)),
        "step_s": round(t, 4), "first_step_s": round(first, 2),
        "context_tokens_per_s": round(L / t, 1), "block_tokens_per_s": round(n * drafter.block_size / t, 1),
        "tflops": round(flops / t / 1e12, 2), "mfu": round(flops / t / peak, 3) if peak else None,
        "first_step_compiled": {"graphs": after_first["graphs"], "recompiles": after_first["recompiles"]},
        "timed_steps_compiled": timed_compiled, "recompile_limit_hits": watch.hits,
        "recompile_reasons": watch.recompiles[:10],
        "peak_memory_gib": round(measured / 2**30, 3), "plan_peak_gib": round(estimate / 2**30, 3),
        "plan_phase": phase, "plan_over_measured": round(estimate / measured, 3),
        # the forward and backward alone (before the optimizer step): its peak, and its rise over what the step
        # started with (the activations and gradients it makes), each next to the plan's
        "activation_peak_gib": round(window / 2**30, 3), "plan_activation_peak_gib": round(window_plan / 2**30, 3),
        "plan_activation_phase": window_phase, "plan_activation_over_measured": round(window_plan / window, 3),
        "activation_rise_gib": round((window - start) / 2**30, 3),
        "plan_activation_rise_over_measured": round(rise_plan / (window - start), 3),
        "profile": profile}


def profile_cost(step_s: float) -> float:
    """Seconds to budget for one profiled step of `step_s`: the profiler's start (CUPTI's, on CUDA), the step
    slowed by recording its ops, and reading the trace back."""
    return 15 + 10 * step_s


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


# `python -m bench` suites (a table row each; bench/gpu_check.sh runs the checks instead)

def gpu_train_step(quick: bool, device, **_) -> dict:
    """CUDA only: the compiled flex training step at Qwen3-8B drafter size over several lengths."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    return flex_lengths([3072] if quick else [3072, 4096, 2048, 1024], 512, 600, device)


def gpu_extraction_kernels(quick: bool, device, **_) -> dict:
    """CUDA only: features of a tiny hybrid target with fla kernels vs the PyTorch fallback."""
    import importlib.util

    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    if importlib.util.find_spec("fla") is None:
        return {"skipped": "flash-linear-attention is not installed (pip install 'dflash[gpu]')"}
    from bench.gpu.target import extraction_kernels

    return extraction_kernels(device)
