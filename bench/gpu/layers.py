"""Two GPU checks of how training runs the drafter's layers, each at the Qwen3.6-27B drafter's step
(bench.gpu.steps.QWEN3_6_PRESET: 3072 tokens, 512 anchors, compiled flex, bf16 autocast), one drafter and one batch:

- `checkpointing_modes`: the forward and backward under each train.gradient_checkpointing mode in turn, its time
  and peak memory beside the memory plan's. train.gradient_checkpointing=auto takes the first of no checkpointing,
  selective and full whose planned peak fits the device, so it holds two things only a GPU can show: each mode's
  planned peak is the measured one (within bench.gpu.verdicts.PLAN_TOL), and selective checkpointing costs less
  time than full (were it slower, auto would choose it where full is the better buy).
- `compiled_layers`: the forward and backward eager, then with train.compile=layers (dflash.drafter.recompute.
  compile_layers): the compile's seconds and graphs, the speed-up (what decides whether layers become the default),
  the loss against eager's, and nothing compiled again by the timed steps or by another length of the same padded
  shape.

On CPU tests/bench/gpu/test_layers.py runs the same code at a tiny size.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from bench.gpu.steps import (QWEN3_6_PRESET, CompileWatch, _sync, loss_and_backward, make_batch, preset_drafter,
                              preset_job)
from bench.gpu.verdicts import PLAN_TOL
from bench.measure import TensorPeak, timed
from dflash.drafter.recompute import MODES, compile_layers, use_checkpointing
from dflash.plan.configured import checkpointing_of


def preset_fwd_bwd(device, overrides: list[str]) -> SimpleNamespace:
    """A preset's drafter (training mode) and its forward and backward of one batch, `fwd_bwd(blocks, feats)` -> the
    loss, the drafter's gradients freed first as the optimizer's zero_grad does; with the plan's job, shape and
    setup, the target's embed and head, and whether it runs under bf16 autocast."""
    job, shape, setup = preset_job(overrides)
    drafter, embed, head = preset_drafter(job, device)
    drafter.train()
    gamma, autocast = job["loss"].gamma_for(drafter.block_size), setup.compute == 2

    def fwd_bwd(blocks, feats) -> float:
        drafter.zero_grad(set_to_none=True)
        return loss_and_backward(drafter, embed, head.weight, feats, blocks, setup.backend, autocast, gamma,
                                 job["loss"].chunk_logits)

    return SimpleNamespace(job=job, shape=shape, setup=setup, drafter=drafter, embed=embed, head=head,
                           autocast=autocast, fwd_bwd=fwd_bwd)


def measure_modes(device, overrides: list[str] = QWEN3_6_PRESET, repeat: int = 3) -> dict:
    """Per mode: the forward and backward's median time over `repeat` after one untimed (the first compiles flex),
    its peak and the plan's (peak among its BACKWARD phases) and the loss; the drafter's gradients are freed
    between steps, as the optimizer's zero_grad does."""
    from dataclasses import replace

    from dflash.plan.memory import BACKWARD, peak, terms
    from dflash.train.batches import add_noise

    p = preset_fwd_bwd(device, overrides)
    shape, setup, drafter, autocast = p.shape, p.setup, p.drafter, p.autocast
    blocks, clean = make_batch(drafter, setup.ctx_len, setup.num_anchors, device, spread=True)
    feats = add_noise(clean, p.job["noise"], len(drafter.target_layer_ids), 0, 0, [0])
    losses = {}

    def backward(mode):
        losses[mode] = p.fwd_bwd(blocks, feats)

    out = {"shape": f"{' '.join(overrides)}: {len(drafter.layers)} layers, hidden {drafter.config.hidden_size}, "
                    f"{setup.ctx_len} tokens, {setup.num_anchors} anchors, {setup.backend}, "
                    f"{'bf16 autocast' if autocast else 'float32'}", "modes": {}}
    for mode in MODES:
        use_checkpointing(drafter, mode)
        t0 = time.perf_counter()
        backward(mode)
        _sync(device)
        first = time.perf_counter() - t0
        t = timed(lambda: backward(mode), repeat=repeat, warmup=0)
        drafter.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            backward(mode)
            _sync(device)
            measured = torch.cuda.max_memory_allocated(device)
        else:
            with TensorPeak() as mem:
                mem.track(*drafter.parameters(), *drafter.buffers(), p.embed.weight, p.head.weight, clean, feats,
                          *[v for v in vars(blocks).values() if torch.is_tensor(v)])
                backward(mode)
            measured = mem.peak
        # no AdamW state here: the plan's peak without it
        planned = peak(shape, replace(setup, checkpointing=checkpointing_of(mode), foreach=False), BACKWARD)[0]
        planned -= terms(shape, setup)["AdamW state (2 x fp32)"]
        out["modes"][mode] = {"fwd_bwd_s": round(t, 4), "first_s": round(first, 2),
                                     "peak_bytes": int(measured), "peak_gib": round(measured / 2**30, 3),
                                     "plan_peak_gib": round(planned / 2**30, 3),
                                     "plan_over_measured": round(planned / measured, 3), "loss": losses[mode]}
    drafter.zero_grad(set_to_none=True)
    return out


def modes_verdict(out: dict) -> dict:
    """PASS when every mode's planned peak is within PLAN_TOL of the measured one, the peaks fall from no
    checkpointing to selective to full, the three losses agree (bf16: to 1e-3), and selective's step is faster
    than full's."""
    m, why = out["modes"], []
    for name, r in m.items():
        if abs(r["plan_over_measured"] - 1) > PLAN_TOL:
            why.append(f"{name}: the plan's peak {r['plan_peak_gib']} GiB is {r['plan_over_measured']}x the measured "
                       f"{r['peak_gib']} GiB (tolerance {PLAN_TOL:.0%}): correct the plan's checkpointing terms")
    if not m["off"]["peak_bytes"] > m["selective"]["peak_bytes"] > m["full"]["peak_bytes"]:
        why.append("the peaks do not fall from off to selective to full: " +
                   ", ".join(f"{k} {r['peak_gib']} GiB" for k, r in m.items()))
    if max(abs(r["loss"] - m["off"]["loss"]) for r in m.values()) > 1e-3 * abs(m["off"]["loss"]):
        why.append("the modes' losses differ: " + ", ".join(f"{k} {r['loss']:.6f}" for k, r in m.items()))
    sel, full, off = (m[k]["fwd_bwd_s"] for k in ("selective", "full", "off"))
    if sel >= full:
        why.append(f"selective checkpointing's step ({sel} s) is not faster than full's ({full} s): auto's order "
                   f"(off, selective, full) should put full before selective")
    ratios = {"selective_over_off": round(sel / off, 3), "full_over_off": round(full / off, 3),
              "selective_over_full": round(sel / full, 3)}
    figures = (f"{out['shape']}: forward and backward " + ", ".join(f"{k} {r['fwd_bwd_s']} s" for k, r in m.items())
               + f" (selective x{ratios['selective_over_off']}, full x{ratios['full_over_off']} of off); peaks "
               + ", ".join(f"{k} {r['peak_gib']} GiB (plan x{r['plan_over_measured']})" for k, r in m.items()))
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures,
            **ratios, **out}


def checkpointing_modes(budget: float) -> dict:
    """CUDA only: measure_modes at the Qwen3.6-27B preset, judged by modes_verdict."""
    if not torch.cuda.is_available():
        return {"status": "SKIP", "summary": "needs CUDA (the Qwen3.6-27B drafter's step in three modes; "
                                             "tests/bench/gpu/test_layers.py runs the same code on CPU at a tiny size)"}
    return modes_verdict(measure_modes(torch.device("cuda")))


COMPILED_LOSS_TOL = 1e-2  # compiled against eager under bf16 autocast: the kernels sum in other orders


def measure_compiled(device, overrides: list[str] = QWEN3_6_PRESET, repeat: int = 3, backend: str = "inductor",
                     other_length: int = 3000) -> dict:
    """The forward and backward without checkpointing, eager (median of `repeat` after one untimed), then through
    compile_layers(backend): the first step (the compile), the median of `repeat`, dynamo's graphs and recompiles
    in each, and one step at `other_length` tokens (padded to the same shape under flex: it must compile nothing)."""
    from bench.gpu.steps import _compiled_between

    p = preset_fwd_bwd(device, overrides)
    setup, drafter, autocast, backward = p.setup, p.drafter, p.autocast, p.fwd_bwd

    blocks, feats = make_batch(drafter, setup.ctx_len, setup.num_anchors, device, spread=True)
    other = make_batch(drafter, other_length, setup.num_anchors, device, spread=True, seed=1)
    eager_loss = backward(blocks, feats)
    eager = timed(lambda: backward(blocks, feats), repeat=repeat, warmup=0)
    compile_layers(drafter, backend)
    with CompileWatch() as watch:
        start = watch.mark()
        t0 = time.perf_counter()
        loss = backward(blocks, feats)
        _sync(device)
        first, after_first = time.perf_counter() - t0, watch.mark()
        compiled = timed(lambda: backward(blocks, feats), repeat=repeat, warmup=0)
        after_timed = watch.mark()
        backward(*other)
        _sync(device)
        after_other = watch.mark()
    drafter.zero_grad(set_to_none=True)
    return {"shape": f"{' '.join(overrides)}: {len(drafter.layers)} layers ({len(set(drafter.layer_types))} kinds), "
                     f"{setup.ctx_len} tokens, {setup.num_anchors} anchors, {setup.backend}, "
                     f"{'bf16 autocast' if autocast else 'float32'}, {backend}",
            "eager_s": round(eager, 4), "compiled_s": round(compiled, 4), "first_compiled_s": round(first, 2),
            "eager_over_compiled": round(eager / compiled, 3), "loss": loss, "eager_loss": eager_loss,
            "first_step_compiled": _compiled_between(start, after_first),
            "timed_steps_compiled": _compiled_between(after_first, after_timed),
            "other_length": other_length, "other_length_compiled": _compiled_between(after_timed, after_other),
            "recompile_reasons": watch.recompiles[:10]}


def compiled_verdict(out: dict) -> dict:
    """PASS when the compiled step's loss is eager's (COMPILED_LOSS_TOL), the first step compiled and nothing after
    it did (the timed steps, another length of the same padded shape). The speed-up is reported, not judged: it
    decides whether train.compile=layers becomes the default."""
    why = []
    if abs(out["loss"] - out["eager_loss"]) > COMPILED_LOSS_TOL * abs(out["eager_loss"]):
        why.append(f"the compiled step's loss {out['loss']:.5f} is not eager's {out['eager_loss']:.5f} "
                   f"(tolerance {COMPILED_LOSS_TOL:.0%})")
    if not out["first_step_compiled"]["graphs"]:
        why.append("the first compiled step compiled no graph")
    for key, what in (("timed_steps_compiled", "the timed steps"),
                      ("other_length_compiled", f"a step of {out['other_length']} tokens (the same padded shape)")):
        if out[key]["graphs"] or out[key]["recompiles"]:
            why.append(f"{what} compiled again: {out[key]}" + (f" ({out['recompile_reasons'][-1]})"
                                                              if out["recompile_reasons"] else ""))
    figures = (f"{out['shape']}: forward and backward eager {out['eager_s']} s, compiled {out['compiled_s']} s "
               f"(x{out['eager_over_compiled']} faster), first compiled step {out['first_compiled_s']} s, "
               f"{out['first_step_compiled']['graphs']} graphs")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures, **out}


def compiled_layers(budget: float) -> dict:
    """CUDA only: measure_compiled at the Qwen3.6-27B preset, judged by compiled_verdict."""
    if not torch.cuda.is_available():
        return {"status": "SKIP", "summary": "needs CUDA (the Qwen3.6-27B drafter's step eager and with compiled "
                                             "layers; tests/bench/gpu/test_layers.py runs the same code on CPU at a "
                                             "tiny size)"}
    return compiled_verdict(measure_compiled(torch.device("cuda")))
