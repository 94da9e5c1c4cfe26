"""The checks of bench/gpu_check.sh: each prints one `PASS|FAIL|SKIP <check> <figures or why>` line.

    python -m bench.gpu_checks                      # every check, each in its own process and time limit
    python -m bench.gpu_checks --only live_lossless autocast_loss
    python -m bench.gpu_checks --check flex_train_step --result r.json   # one check, in this process

Writes bench/results/<date>-<machine>-gpu-check.json after every check (and a copy under $OUT when set;
bench/gpu_runner.py says how a killed check or run keeps what finished). On a machine without CUDA the
GPU-only checks print SKIP with the reason and the others run small. Exit status 1 when a check FAILed.
A check may also be named `module:function` (a function taking the budget in seconds and returning
{"status", "summary", ...}): the tests run fake checks so.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.gpu_runner import REPO, run_all, save_partial
from dflash.io import write_json

RESULTS = Path(__file__).parent / "results"

# flex lengths: the recipe's (3072, data.max_length of the presets) and 4096 first, then lengths that
# share a padded shape with one measured before (3000 with 3072, 2000 with 2048, 1000 with 1024: the
# context is padded to a multiple of 256), each right after its partner, so a reused graph is checked
# early and costs no compile
FLEX_LENGTHS = [3072, 4096, 3000, 2048, 2000, 1024, 1000, 1500]
RECIPE_LENGTH = 3072
FLEX_ANCHORS = 512
LOSS_REL_TOL = 1e-2  # bf16 autocast against float32: see autocast_loss
GRAD_COS_MIN = 0.99
PLAN_TOL = 0.15  # bench.plan's peak against the measured one (tests/test_plan.py holds it to this on CPU)
BF16_TIE_MARGIN = 0.1  # what dflash.evaluate.live takes for a numerical tie of bf16 logits (eval.tie_margin null)

# check -> time limit in seconds on an H200: the three timing checks alone, one after the other (each pays
# a cold compile of flex attention; on the first H200 they took 46 s, 31 s and 26 s), then the rest side by side
# within what is left of 480 s, so that bench/gpu_check.sh with its install ends within 10 minutes. The two
# checks that run fla's kernels spend most of their time in Triton's autotuning of them, once per key and dtype
# in a fresh process (2026-12-04 H200: 22 autotunings, 234 s, in fla_kernels; 17, 143 s, in live_lossless; a
# first forward 45 s): side by side with each other only they took 264 s and 282 s, past the 150 s they had
TIMEOUTS = {"flex_train_step": 160, "qwen3_6_step": 170, "gpu_tests": 150, "autocast_loss": 150,
            "fla_kernels": 360, "live_lossless": 360, "qwen3_6_dflash2_step": 150, "vllm_dflash2": 150}
# their tokens/s and MFU need the GPU to themselves (bench.plan takes a preset's MFU from its step): the DFlash 2
# step ran at MFU 0.15 beside the other checks and 0.20 alone on the first H200
ALONE = ("flex_train_step", "qwen3_6_step", "qwen3_6_dflash2_step")
DEFAULT_BUDGET = 480


def _cuda() -> torch.device | None:
    return torch.device("cuda") if torch.cuda.is_available() else None


def gpu_tests(budget: float) -> dict:
    """The tests marked `gpu` (pytest -m gpu)."""
    if _cuda() is None:
        return {"status": "SKIP", "summary": "needs CUDA (the gpu-marked tests skip themselves on CPU)"}
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    if importlib.util.find_spec("pytest_timeout"):  # a hanging test fails alone, with its traceback
        cmd.append(f"--timeout={int(budget)}")
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = (run.stdout + run.stderr).strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])} \
        if lines else {}
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    ok = run.returncode == 0 and counts.get("passed", 0) > 0
    summary = lines[-1] if lines else f"pytest exited {run.returncode} with no output"
    return {"status": "PASS" if ok else "FAIL", "summary": summary + ("; " + "; ".join(failed) if failed else ""),
            "counts": counts, "tail": lines[-40:]}


def flex_verdict(out: dict, flex: bool = True, recipe: int = RECIPE_LENGTH) -> dict:
    """PASS or FAIL for bench.gpu.flex_lengths' results, by dynamo's own counts: FAIL when a length of an
    already compiled padded shape compiled a graph (a recompile: each batch would pay it again), when a
    step after a length's first compiled anything, when the recompile limit was hit (flex then runs
    uncompiled), when a new shape compiled nothing under flex (it ran uncompiled), when the recipe's
    length was not measured, or when no measured length reused a shape (the reuse went untested)."""
    rec, why = out["lengths"], []
    if out["recompile_limit_hits"]:
        why.append(f"recompile limit hit: {out['recompile_limit_hits'][0]}")
    again = {L: r for L, r in rec.items() if r["timed_steps_compiled"]["graphs"]
             or (not r["new_shape"] and r["first_step_compiled"]["graphs"])}
    if again:
        why.append("recompiled a compiled shape: " + ", ".join(
            f"{L} ({r['first_step_compiled']['graphs'] * (not r['new_shape'])} graphs in its first step, "
            f"{r['timed_steps_compiled']['graphs']} in the steps after)" for L, r in again.items())
            + (f"; dynamo: {out['recompile_reasons'][-1]}" if out.get("recompile_reasons") else ""))
    new = {L: r for L, r in rec.items() if r["new_shape"]}
    if flex and any(r["first_step_compiled"]["graphs"] == 0 for r in new.values()):
        uncompiled = [L for L, r in new.items() if not r["first_step_compiled"]["graphs"]]
        why.append(f"no graph compiled for a new shape ({uncompiled}): flex ran uncompiled")
    if recipe not in rec:
        why.append(f"the recipe's length {recipe} was not measured")
    reused = [L for L, r in rec.items() if not r["new_shape"]]
    if rec and not reused:
        why.append("no measured length reused a compiled shape: graph reuse went untested")
    r = list(rec.values())
    best = max(r, key=lambda x: x["tflops"]) if r else {}
    mfus = [x["mfu"] for x in r if x["mfu"] is not None]
    peaks = [x["peak_memory_gib"] for x in r if x["peak_memory_gib"] is not None]
    c = out["compiles"]
    figures = (f"{len(rec)}/{len(rec) + len(out['skipped'])} lengths ({', '.join(map(str, rec))})"
               + (f", skipped for time {sorted(out['skipped'])}" if out["skipped"] else "")
               + f", {min((x['context_tokens_per_s'] for x in r), default=0):.0f}-"
                 f"{max((x['context_tokens_per_s'] for x in r), default=0):.0f} context tok/s, "
                 f"{best.get('tflops', 0)} TFLOP/s best, "
               + (f"mfu {min(mfus):.3f}-{max(mfus):.3f}" if mfus else "mfu n/a")
               + f", peak {max(peaks, default=0)} GiB; dynamo: {c['dynamo_graphs']} graphs, {c['dynamo_recompiles']} "
                 f"recompiles for {len(new)} new shapes, 0 expected for the {len(reused)} reused "
                 f"({', '.join(map(str, reused)) or 'none'}); dflash's flex count {c['flex_compile_count']}")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures, **out}


def flex_train_step(budget: float) -> dict:
    """Compiled flex training steps at Qwen3-8B drafter size over FLEX_LENGTHS within the budget (the
    recipe's lengths first): tokens/s, MFU, peak memory, and graph reuse judged by `flex_verdict`."""
    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (flex attention trains on CUDA only)"}
    from bench.gpu import flex_lengths

    return flex_verdict(flex_lengths(FLEX_LENGTHS, FLEX_ANCHORS, budget, device, on_length=save_partial))


def preset_verdict(out: dict) -> dict:
    """PASS when bench.plan's peak is within PLAN_TOL of the measured one, nothing compiled after the
    first step, the recompile limit was not hit and (under flex) the first step compiled."""
    why, ratio = [], out["plan_over_measured"]
    if abs(ratio - 1) > PLAN_TOL:
        why.append(f"bench.plan's peak {out['plan_peak_gib']} GiB ({out['plan_phase']}) is {ratio:.3f}x the measured "
                   f"{out['peak_memory_gib']} GiB (tolerance {PLAN_TOL:.0%}): correct the plan's terms")
    if out["timed_steps_compiled"]["graphs"]:
        why.append(f"{out['timed_steps_compiled']['graphs']} graphs compiled after the first step (a recompile of "
                   f"the same shape)" + (f": {out['recompile_reasons'][-1]}" if out["recompile_reasons"] else ""))
    if out["recompile_limit_hits"]:
        why.append(f"recompile limit hit: {out['recompile_limit_hits'][0]}")
    if out["backend"] == "flex" and not out["first_step_compiled"]["graphs"]:
        why.append("the first step compiled no graph: flex ran uncompiled")
    figures = (f"{out['shape']}: {out['context_tokens_per_s']:.0f} context tok/s ({out['block_tokens_per_s']:.0f} "
               f"block tok/s), {out['tflops']} TFLOP/s, "
               + (f"mfu {out['mfu']}" if out["mfu"] is not None else "mfu n/a")
               + f", first step {out['first_step_s']} s; dynamo: {out['first_step_compiled']['graphs']} graphs for "
                 f"{out['mask_kinds']} mask kinds, {out['timed_steps_compiled']['graphs']} after; peak "
                 f"{out['peak_memory_gib']} GiB, plan {out['plan_peak_gib']} GiB (x{ratio}, {out['plan_phase']})")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures, **out}


def qwen3_6_step(budget: float) -> dict:
    """The Qwen3.6-27B drafter's compiled flex training step at 3072 tokens and 512 anchors
    (bench.gpu.preset_step), judged by `preset_verdict`."""
    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (a 1.8B-parameter drafter step through flex attention; "
                                             "tests/test_gpu_check.py runs the same code on CPU at a tiny size)"}
    from bench.gpu import QWEN3_6_PRESET, preset_step

    return preset_verdict(preset_step(device, QWEN3_6_PRESET))


def qwen3_6_dflash2_step(budget: float) -> dict:
    """The published 27B DFlash 2 drafter's compiled flex step (5 non-causal sliding layers, blocks of 8, the
    convolutions and the selector's loss) at 3072 tokens and 512 anchors, judged by `preset_verdict`: bench.plan's
    DFlash 2 terms against the measured peak. Run alone, after the other two timing checks."""
    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (a 2.0B-parameter DFlash 2 drafter step through flex "
                                             "attention)"}
    from bench.gpu import QWEN3_6_DFLASH2_PRESET, preset_step

    return preset_verdict(preset_step(device, QWEN3_6_DFLASH2_PRESET))


def autocast_loss(budget: float) -> dict:
    """bf16 autocast against float32 on one batch (same weights, same features). bf16 keeps 8 bits of
    mantissa (relative rounding up to 2^-9 per value), but autocast keeps softmax, norms and the
    cross-entropy in float32, matmuls accumulate in float32, and the loss is a mean over thousands of
    label slots whose rounding errors mostly cancel: a correct run moves it by ~1e-5..1e-4 relative
    (measured on CPU). 1e-2 leaves two orders of magnitude for the larger GPU shapes and still catches
    what breaks bf16 training (a reduction or softmax left in bf16, a mask that changes under
    autocast, an overflow), which moves the loss by percents or makes it non-finite. The gradient
    direction must also agree (cosine >= 0.99: a bf16 backward through the wrong mask does not)."""
    from bench.gpu import QWEN3_8B, SMALL, autocast_gap

    device = _cuda() or torch.device("cpu")
    if device.type == "cuda":  # Qwen3-8B drafter size, through flex as training runs on CUDA
        out = autocast_gap(device, QWEN3_8B, length=1024, num_anchors=128, backend="flex")
    else:  # a small stand-in through the SDPA path that training uses on CPU
        out = autocast_gap(device, SMALL, length=512, num_anchors=64, backend="sdpa")
    ok = out["loss_rel_diff"] <= LOSS_REL_TOL and out["grad_cosine"] >= GRAD_COS_MIN
    figures = (f"on {device.type}: loss fp32 {out['loss_float32']:.4f} bf16 {out['loss_bf16_autocast']:.4f} "
               f"(rel diff {out['loss_rel_diff']:.2e}, tol {LOSS_REL_TOL}), grad cosine {out['grad_cosine']:.5f} "
               f"(min {GRAD_COS_MIN}), grad norm ratio {out['grad_norm_ratio']:.4f}")
    return {"status": "PASS" if ok else "FAIL", "summary": figures, **out}


def kernel_verdict(out: dict, label: str) -> tuple[list[str], str]:
    """(why it fails, figures) for bench.gpu_target.extraction_kernels' results. Fails when transformers
    did not bind fla; when fla's bf16 error against the float32 reference is not of the size of the
    fallback's own bf16 error (mean within 5x, max within 10x: fla keeps more intermediates in bf16, so it
    may round a few times more, while a wrong kernel is off by the size of the output itself); or when fla
    in float32 fails, or is further from the reference than the fallback in bf16 (TF32 dots round far
    less than bf16; a wrong kernel does not)."""
    why = []
    if out["kernels"].get("linear_attention") != "fla":
        try:  # why transformers fell back: it swallows the import error
            import fla  # noqa: F401
            reason = "fla imports; transformers did not bind it"
        except Exception as e:  # noqa: BLE001 - reported, not handled
            reason = f"import fla fails: {type(e).__name__}: {e}"
        why.append(f"{label}: fla is not bound ({out['kernels']}); {reason}")
    elif out["deltanet_max_abs_diff"] == 0:
        why.append(f"{label}: fla and the fallback agree to the bit: the swap to the fallback "
                   f"({out['fallback_swapped']}) changed nothing")
    floor = 1e-6 * out["deltanet_rms"]
    ratio = {k: out[f"deltanet_bound_err_{k}"] / max(out[f"deltanet_fallback_err_{k}"], floor) for k in ("mean", "max")}
    if ratio["mean"] > 5 or ratio["max"] > 10:
        why.append(f"{label}: fla's bf16 error against float32 is {ratio['mean']:.1f}x (mean) / {ratio['max']:.1f}x "
                   f"(max) the fallback's")
    if "float32_error" in out:
        why.append(f"{label}: the bound kernels fail in float32: {out['float32_error']}")
    elif out["deltanet_bound_float32_err_max"] > out["deltanet_fallback_err_max"]:
        why.append(f"{label}: in float32 the bound kernels are {out['deltanet_bound_float32_err_max']:.3g} (max) off "
                   f"the reference, more than the fallback in bf16 ({out['deltanet_fallback_err_max']:.3g})")
    rms = out["features_rms"]
    f32 = out.get("features_max_abs_diff_float32")
    figures = (f"{label} ({out['shape']}): kernels {','.join(f'{k}={v}' for k, v in sorted(out['kernels'].items()))}; "
               f"max feature diff bound vs fallback: bf16 {out['features_max_abs_diff']:.3g}, float32 "
               + (f"{f32:.3g}" if f32 is not None else "n/a") + f" (feature rms {rms:.3g}); DeltaNet output max diff "
               f"{out['deltanet_max_abs_diff'] / out['deltanet_rms']:.3g} of its rms; error vs fp32, bound over "
               f"fallback: {ratio['mean']:.2f}x mean, {ratio['max']:.2f}x max; fallback "
               f"{out['fallback_over_bound']}x slower")
    return why, figures


def fla_kernels(budget: float) -> dict:
    """fla against the PyTorch fallback on the tiny hybrid target and on a mid-size one with the real
    head dims (bench.gpu_target.mid_hybrid_config), judged by `kernel_verdict`."""
    import importlib.util

    device = _cuda()
    if device is None:
        return {"status": "SKIP", "summary": "needs CUDA (fla's kernels are Triton, CUDA only; on CPU they "
                                             "would break every forward)"}
    if importlib.util.find_spec("fla") is None:
        return {"status": "FAIL", "summary": "flash-linear-attention is not installed (bench/prepare_wheels.sh, "
                                             "or pip install flash-linear-attention)"}
    from bench.gpu_target import extraction_kernels, mid_hybrid_config

    start = time.time()
    tiny = extraction_kernels(device)
    print(f"fla_kernels: tiny done in {time.time() - start:.1f} s (bound {tiny['bound_s']} s a forward)", flush=True)
    save_partial({"tiny": tiny})
    mid = extraction_kernels(device, mid_hybrid_config(), batch=2, length=2048)
    print(f"fla_kernels: head dims 128 done in {time.time() - start:.1f} s", flush=True)
    why, parts = [], []
    for label, out in (("tiny", tiny), ("head dims 128", mid)):
        w, figures = kernel_verdict(out, label)
        why += w
        parts.append(figures)
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why + parts), "tiny": tiny, "mid": mid}


def lossless_verdict(out: dict) -> dict:
    """float32: every speculative run must equal plain greedy decoding exactly. bf16: every divergence is
    listed with the target's top-2 logit margin there, and fails unless it is a numerical tie (margin
    under BF16_TIE_MARGIN: batched and one-token bf16 forwards round differently). Either dtype fails
    when an oracle drafter had nothing accepted (the accepting paths went unexercised)."""
    runs, why, parts = out["runs"], [], []

    def where(r):
        d = r["divergence"]
        margin = "n/a" if d["margin"] is None else f"{d['margin']:.3g}"
        return (f"{r['target']}/{r['prompt']}/{r['drafter']}" + (f"/tree{r['tree_budget']}" if r["tree_budget"] else "")
                + f" at token {d['at']} (plain {d['plain']}, spec {d['spec']}, margin {margin})")

    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        rs = [r for r in runs if r["dtype"] == dtype]
        diverged = [r for r in rs if not r["identical"]]
        oracle = [r["tau"] for r in rs if r["drafter"] == "oracle"]
        parts.append(f"{dtype} {len(rs) - len(diverged)}/{len(rs)} identical, oracle tau "
                     f"{sum(oracle) / len(oracle):.2f}"
                     + (f", divergences: {'; '.join(map(where, diverged))}" if diverged else ""))
        if dtype == "float32" and diverged:
            why.append(f"float32: {len(diverged)} runs differ from plain greedy decoding (must be identical)")
        clear = [r for r in diverged if r["divergence"]["margin"] is None
                 or r["divergence"]["margin"] >= BF16_TIE_MARGIN]
        if dtype != "float32" and clear:
            why.append(f"{dtype}: {len(clear)} divergences at a clear logit margin (>= {BF16_TIE_MARGIN}): not a tie")
        if any(t <= 1 for t in oracle):
            why.append(f"{dtype}: an oracle drafter had nothing accepted")
    kernels = next((r["kernels"] for r in runs if r["target"] == "toy"), {})
    return {"status": "FAIL" if why else "PASS",
            "summary": "; ".join(why) + (": " if why else "") + "; ".join(parts) + f"; toy kernels {kernels}", **out}


def live_lossless(budget: float) -> dict:
    """Live speculative decoding against plain greedy decoding, float32 and bf16, judged by
    `lossless_verdict`."""
    from bench.gpu_target import live_lossless as run

    device = _cuda() or torch.device("cpu")

    def progress(out: dict) -> None:  # a line per run into the check's log, and the runs so far kept
        r = out["runs"][-1]
        print(f"live_lossless {len(out['runs'])}: {r['target']} {r['dtype']} {r['prompt']} {r['drafter']} "
              f"tree {r['tree_budget']}: {'identical' if r['identical'] else 'DIVERGED'}, tau {r['tau']}, "
              f"{r['seconds']} s", flush=True)
        save_partial(out)

    prompts, tokens = (2, 64) if device.type == "cuda" else (1, 32)  # on CPU a smoke test of the same code
    out = run(device, prompts=prompts, new_tokens=tokens, on_run=progress)
    result = lossless_verdict(out)
    result["summary"] = f"on {device.type}: {result['summary']}"
    return result


def vllm_dflash2(budget: float) -> dict:
    """What vLLM's CPU build cannot serve (`make engines` records its refusals), served through vLLM on the GPU:
    a DFlash 2 drafter (its selector walk is a Triton kernel) and a mixed sliding/full one (V2 model runner
    only), each against our live evaluation as bench.engines.vllm_check compares them. Needs vllm importable
    in this interpreter: the device image has none, and its CUDA wheel is larger than a device run carries."""
    import importlib.util

    if _cuda() is None:
        return {"status": "SKIP", "summary": "needs CUDA (vLLM's CPU build refuses these exports: make engines)"}
    if importlib.util.find_spec("vllm") is None:
        return {"status": "SKIP", "summary": "vllm is not installed here; pip install vllm, then rerun this check"}
    from bench.engines import vllm_check

    out = vllm_check.check(sys.executable, REPO / "build" / "engines" / "vllm-gpu", exports=["dflash2", "mixed"])
    return {"status": "PASS" if out["ok"] else "FAIL", "summary": vllm_check.verdict(out).replace("\n", "; "),
            "result": out}


GPU_ONLY = {"flex_train_step", "qwen3_6_step", "gpu_tests", "fla_kernels", "qwen3_6_dflash2_step", "vllm_dflash2"}
CHECKS = {"flex_train_step": flex_train_step, "qwen3_6_step": qwen3_6_step, "gpu_tests": gpu_tests,
          "autocast_loss": autocast_loss, "fla_kernels": fla_kernels, "live_lossless": live_lossless,
          "qwen3_6_dflash2_step": qwen3_6_dflash2_step, "vllm_dflash2": vllm_dflash2}


def resolve(name: str):
    """The check function of `name`: one of CHECKS, or `module:function`."""
    if name in CHECKS:
        return CHECKS[name]
    module, sep, fn = name.partition(":")
    if not sep:
        raise SystemExit(f"gpu_checks: no check {name!r}; the checks are {', '.join(CHECKS)} (or module:function)")
    return getattr(importlib.import_module(module), fn)


def run_one(name: str, budget: float) -> dict:
    t = time.time()
    try:
        out = resolve(name)(budget)
    except Exception as e:  # noqa: BLE001 - a crash is a FAIL line, not a lost report
        import traceback

        traceback.print_exc()  # into the check's log, whose tail a FAIL line shows
        out = {"status": "FAIL", "summary": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
               "traceback": traceback.format_exc().splitlines()[-30:]}
    out["seconds"] = round(time.time() - t, 1)
    return out


def run_plan(names: list[str]) -> dict:
    """How bench.gpu_runner.run_all runs `names`: on CUDA the timing checks alone, one after the other,
    then the rest side by side; on CPU one by one. GPU-only checks SKIP on CPU without a process."""
    cuda = _cuda() is not None
    if cuda:
        waves = [[n] for n in names if n in ALONE] + [[n for n in names if n not in ALONE]]
    else:
        waves = [[n] for n in names]
    return {"device": "cuda" if cuda else "cpu", "waves": [w for w in waves if w],
            "timeout": lambda n: TIMEOUTS.get(n) or getattr(resolve(n), "timeout_s", 60),
            "skip": lambda n: run_one(n, 0) if n in GPU_ONLY and not cuda else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help=f"run only these checks ({', '.join(CHECKS)})")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"seconds for all checks (default {DEFAULT_BUDGET})")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON (default bench/results)")
    parser.add_argument("--check", help=argparse.SUPPRESS)  # one check, in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.check:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        write_json(args.result, run_one(args.check, args.budget))
        return 0
    names = args.only or list(CHECKS)
    for name in names:
        resolve(name)  # an unknown name stops here, not in a child
    report = run_all(names, args.budget, args.results, run_plan(names))
    return 1 if report["summary"]["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
