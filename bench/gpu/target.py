"""GPU measurements of the target side, for bench/gpu/checks.py: the linear-attention kernels
transformers binds (fla) against its PyTorch fallback, and live speculative decoding against plain
greedy decoding.

- `extraction_kernels`: a hybrid target's features and Gated DeltaNet outputs with the bound kernels
  and with the fallback, in bf16 and in float32, each against the fallback in float32.
- `live_lossless`: speculative decoding checked token for token against plain decoding (where they differ, the
  first divergence and the target's top-2 logit margin there), and every token it committed against the
  target's argmax over its own output.
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager

import torch

from bench.measure import time_call, timed


def mid_hybrid_config(vocab_size: int = 4096):
    """A mid-size Qwen3.5 hybrid with the real models' head dims (Qwen3.5/3.6-27B: Gated DeltaNet heads of
    128, 16 key / 48 value heads; attention heads of 256): hidden 1024, 6 Gated DeltaNet layers (4 key /
    12 value heads of 128) and 2 attention layers (8 / 2 heads of 256). The kernels' tiling, and so their
    rounding, follows the head dims: the tiny target's 16 do not exercise what a 27B target runs."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4,
        linear_num_value_heads=12, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=False)


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
        with torch.no_grad():
            features = target_forward(as_target(model), ids, layers).features.float()
    finally:
        for h in hooks:
            h.remove()
    return features, torch.cat(outs, -1)


def torch_reference(fn):
    """The PyTorch function behind a kernel dispatcher of transformers: its __wrapped__ (before 5.25), or for
    5.25's hub-kernel dispatcher (a `kernels` Func module, no __wrapped__) that of the function its forward
    calls; None for a plain function."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        return inner
    for cell in getattr(getattr(type(fn), "forward", None), "__closure__", None) or ():
        inner = getattr(cell.cell_contents, "__wrapped__", None)
        if callable(inner):
            return inner
    return None


@contextmanager
def fallback_kernels(model):
    """transformers' PyTorch reference code for the Gated DeltaNet layers of `model` while active, whatever
    it bound: the module functions its kernel dispatch wraps (their __wrapped__) and, in versions that bind
    kernels per layer, the layers' own attributes. Yields what was swapped (an error when nothing was: the
    comparison would be the bound kernels against themselves)."""
    linears = [m for m in model.modules() if "GatedDeltaNet" in type(m).__name__]
    module = sys.modules[type(linears[0]).__module__]
    torch_rule = getattr(module, "torch_chunk_gated_delta_rule", None)
    torch_rule = torch_reference(torch_rule) or torch_rule
    saved = []  # (object, attribute, bound value)
    for k in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(module, k, None)
        if torch_reference(fn) is not None:
            saved.append((module, k, fn))
    for m in linears:
        if getattr(m, "chunk_gated_delta_rule", None) is not None and torch_rule is not None:
            saved.append((m, "chunk_gated_delta_rule", m.chunk_gated_delta_rule))
        if getattr(m, "causal_conv1d_fn", None) is not None:
            saved.append((m, "causal_conv1d_fn", m.causal_conv1d_fn))
    if not saved:
        raise RuntimeError(f"{module.__name__} has none of the kernel hooks bench.gpu.target knows "
                           f"(torch_chunk_gated_delta_rule, causal_conv1d_fn): update fallback_kernels")
    try:
        for obj, k, fn in saved:
            fallback = torch_reference(fn) if obj is module else (torch_rule if "rule" in k else None)
            setattr(obj, k, fallback)
        yield sorted({k for _, k, _ in saved})
    finally:
        for obj, k, fn in saved:
            setattr(obj, k, fn)


def extraction_kernels(device, config=None, batch: int = 8, length: int = 1024, repeat: int = 5) -> dict:
    """A hybrid target (default: the tiny one, hidden 64, head dims 16; `mid_hybrid_config` for the real
    head dims) on [batch, length] random tokens: the kernels transformers bound (fla on a CUDA machine
    that has it) and the PyTorch fallback on the same weights, in bf16 and in float32, each compared with
    the fallback in float32 (the reference) at the Gated DeltaNet outputs and at the features; the bf16
    time of each. Keys: kernels; {what}_rms; {what}_max_abs_diff (bound vs fallback, bf16) and
    {what}_max_abs_diff_float32; {what}_{run}_err_{mean,max} for run in bound, fallback, bound_float32
    (what: deltanet, features); float32_error when the bound kernels refuse float32."""
    from transformers import AutoModelForCausalLM

    from dflash.target.builtin import tiny_qwen3_5_config
    from dflash.target.features import target_forward
    from dflash.target.loading import as_target

    config = config or tiny_qwen3_5_config(262)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    target = as_target(model)
    layers = [1, 2, 3, 4, 5]
    ids = torch.randint(0, config.vocab_size - 6, (batch, length), device=device)

    def forward():
        with torch.no_grad():
            target_forward(target, ids, layers)

    runs, out = {}, {"kernels": target.kernels, "shape": f"{config.num_hidden_layers} layers, hidden "
                     f"{config.hidden_size}, linear heads {config.linear_num_key_heads}/{config.linear_num_value_heads}"
                     f" x {config.linear_key_head_dim}, attention heads {config.num_attention_heads} x "
                     f"{config.head_dim}, [{batch}, {length}] tokens"}
    out["bound_first_s"] = round(time_call(forward), 2)  # the kernels' compiles and autotuning for this shape
    out["bound_s"] = round(timed(forward, repeat=repeat, warmup=0), 4)  # warmed up by the call above
    runs["bound"] = _gated_deltanet_outputs(model, ids, layers)
    with fallback_kernels(model) as swapped:
        out["fallback_swapped"] = swapped
        out["fallback_s"] = round(timed(forward, repeat=repeat), 4)
        runs["fallback"] = _gated_deltanet_outputs(model, ids, layers)
        runs["reference"] = _gated_deltanet_outputs(model.float(), ids, layers)
    try:  # the bound kernels in float32 on the same weights
        runs["bound_float32"] = _gated_deltanet_outputs(model, ids, layers)
    except Exception as e:  # noqa: BLE001 - reported: a kernel that refuses float32 is a finding
        out["float32_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    out["fallback_over_bound"] = round(out["fallback_s"] / out["bound_s"], 2)
    for i, what in ((0, "features"), (1, "deltanet")):
        ref = runs["reference"][i]
        out[f"{what}_rms"] = ref.pow(2).mean().sqrt().item()
        out[f"{what}_max_abs_diff"] = (runs["bound"][i] - runs["fallback"][i]).abs().max().item()
        if "bound_float32" in runs:
            out[f"{what}_max_abs_diff_float32"] = (runs["bound_float32"][i] - ref).abs().max().item()
        for name in ("bound", "fallback", "bound_float32"):
            if name in runs:
                err = (runs[name][i] - ref).abs()
                out[f"{what}_{name}_err_mean"], out[f"{what}_{name}_err_max"] = err.mean().item(), err.max().item()
    return out


def first_divergence(target, plain: list[int], spec: list[int], prompt_len: int) -> dict | None:
    """None when speculative decoding produced exactly plain decoding's tokens; else where they first
    differ (generated token index), both tokens, the lengths, and the target's top-2 logit margin at
    that position in a plain forward (a near-tie there is a numerical flip between batched and
    one-token forwards; a clear margin is a verification bug)."""
    from dflash.evaluate.live import _top2  # the margin the evaluation's own lossless check uses

    if plain == spec:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    # one output a prefix of the other (a stop or length bug): no token pair to compare, no margin
    margin, top = _top2(target, plain, pos) if pos < min(len(plain), len(spec)) else (None, None)
    return {"at": pos - prompt_len, "plain": plain[pos:pos + 1], "spec": spec[pos:pos + 1],
            "lengths": [len(plain) - prompt_len, len(spec) - prompt_len], "margin": margin, "top_logit": top}


def live_lossless(device, dtypes=("float32", "bfloat16"), prompts: int = 2, new_tokens: int = 48,
                  on_run=None) -> dict:
    """Speculative decoding against plain greedy decoding, token for token, on the toy target (a
    trained hybrid: the chain with recorded linear states, a DDTree as a batch of its paths) and the tiny
    Qwen3 (attention only: the chain, a DDTree in one sequence), with a drafter that knows the answer but
    misses on purpose (so blocks are partly accepted) and a random real drafter. Each run records its first divergence
    (`first_divergence`, None when identical), every committed token against the target's argmax in one batched
    forward over its output (`committed_tokens`: ties counted apart) and its seconds; bench/gpu/verdicts.py judges.
    `on_run(out)` after each run (the GPU check keeps it as its partial result and prints a line: a first run that
    pays the kernels' compiles and autotuning shows as such in the log)."""
    import os
    import time

    from bench.gpu.verdicts import committed_tokens, tie_margin
    from dflash.config import DrafterConfig, LayersConfig, TargetConfig
    from dflash.data.prompts import encode, load_prompts, prompt_text
    from dflash.drafter.build import build_drafter
    from dflash.drafter.decoding.engine import greedy_generate, speculative_generate
    from dflash.target.features import target_forward
    from dflash.target.loading import load_target
    from tests.oracle import OracleDrafter

    tmp = None if os.environ.get("DFLASH_HOME") else tempfile.TemporaryDirectory(prefix="dflash-gpu-check-")
    home = os.environ.get("DFLASH_HOME") or tmp.name

    def miss(p: int, k: int) -> bool:  # one deliberate miss per 7 slots: blocks partly accepted
        return (p + k) % 7 == 0

    out = {"runs": [], "new_tokens": new_tokens}
    for name, mask in (("toy", 5), ("tiny_qwen3", 261)):
        for dtype in dtypes:
            target = load_target(TargetConfig(name=name, path=f"{home}/targets/{name}", build=name, mask_token_id=mask,
                                              dtype=dtype, device=str(device), allow_fallback_kernels=True), device)
            torch.manual_seed(0)
            real = build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(num=3), target)
            real = real.to(device, target.dtype).eval()
            for prompt in load_prompts("builtin:eval_coding", limit=prompts):
                text = prompt_text(target.tokenizer, prompt, True, False)
                ids = torch.tensor([encode(target.tokenizer, text)], device=device)
                plain = greedy_generate(target, ids, new_tokens)[0].tolist()
                oracle = OracleDrafter(target, plain, block_size=8, wrong=miss).to(device).eval()
                budgets = [None, 8]  # chain, and a DDTree of 8 nodes (hybrid: a batch of its paths)
                for kind, drafter in (("oracle", oracle), ("random", real)):
                    for budget in budgets:
                        start = time.perf_counter()
                        res = speculative_generate(drafter, target, ids, new_tokens, tree_budget=budget)
                        seconds = time.perf_counter() - start
                        spec = res.output_ids[0].tolist()
                        div = first_divergence(target, plain, spec, ids.shape[1])
                        taus, generated = res.acceptance_lengths, res.output_ids.shape[1] - ids.shape[1]
                        with torch.no_grad():  # every committed token, by one forward over the whole output
                            logits = target_forward(target, res.output_ids, [], logits_to_keep=generated + 1).logits
                        checked = committed_tokens(spec, ids.shape[1], logits[0, :-1], tie_margin(dtype))
                        out["runs"].append({"target": name, "kernels": target.kernels, "dtype": dtype,
                                            "prompt": prompt.id, "drafter": kind, "tree_budget": budget,
                                            "identical": div is None, "divergence": div, "tokens": checked,
                                            "tau": round(sum(taus) / len(taus), 3),
                                            "tokens_per_forward": round(generated / res.target_forwards, 3),
                                            "verify_tokens": res.verify_tokens, "seconds": round(seconds, 2)})
                        if on_run is not None:
                            on_run(out)
    if tmp is not None:
        tmp.cleanup()
    return out
