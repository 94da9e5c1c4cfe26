"""The GPU check checkpointing_modes (bench/gpu/layers.py) on CPU: its code path at a tiny size, and its
verdict."""

import pytest
import torch

from bench.gpu.layers import compiled_verdict, measure_compiled, measure_modes, modes_verdict

TINY = ["target=tiny_qwen3", "drafter=tiny", "drafter.layer_types=[sliding_attention,full_attention]",
        "drafter.sliding_window=64", "train.attention=sdpa", "train.mixed_precision=no", "train.num_anchors=24",
        "data.max_length=256"]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_modes_run_on_cpu_and_their_peaks_meet_the_plan(tiny_targets, kind):
    """Each mode's forward and backward at a tiny size (sdpa, float32): the same loss, a peak within 15% of the
    plan's, falling from no checkpointing to selective to full. The speed verdict is the GPU's: here the step is
    too small for the replay's saving to show, so it is set aside."""
    out = measure_modes(torch.device("cpu"), [*TINY, f"drafter.kind={kind}", "drafter.selector_rank=32"], repeat=1)
    m = out["modes"]
    assert list(m) == ["off", "selective", "full"]  # MODES' order
    assert m["off"]["loss"] == m["selective"]["loss"] == m["full"]["loss"]
    for name, r in m.items():
        assert abs(r["plan_over_measured"] - 1) <= 0.15, (name, r)
    assert m["off"]["peak_bytes"] > m["selective"]["peak_bytes"] > m["full"]["peak_bytes"]
    fast = {**out, "modes": {**m, "selective": {**m["selective"], "fwd_bwd_s": m["full"]["fwd_bwd_s"] / 2}}}
    verdict = modes_verdict(fast)
    assert verdict["status"] == "PASS", verdict["summary"]


def result(**changes) -> dict:
    """A measure_modes result with made-up figures (seconds, GiB), `changes` applied per mode."""
    figures = {"off": (1.0, 60, 61.0, 1.017, 20.0), "selective": (1.05, 45, 46.0, 1.022, 2.0),
               "full": (1.3, 35, 35.0, 1.0, 2.0)}
    modes = {name: {"fwd_bwd_s": t, "peak_bytes": gib * 2**30, "peak_gib": float(gib), "plan_peak_gib": plan,
                    "plan_over_measured": ratio, "loss": 5.0, "first_s": first}
             for name, (t, gib, plan, ratio, first) in figures.items()}
    for name, changed in changes.items():
        modes[name] = {**modes[name], **changed}
    return {"shape": "experiment=qwen3_6_27b", "modes": modes}


@pytest.mark.parametrize("case, says", [
    ({}, None),
    ({"selective": {"fwd_bwd_s": 1.3}}, "selective checkpointing's step (1.3 s) is not faster than full's (1.3 s)"),
    ({"selective": {"plan_over_measured": 1.2, "plan_peak_gib": 54.0}}, "selective: the plan's peak 54.0 GiB is 1.2x"),
    ({"selective": {"peak_bytes": 61 * 2**30, "peak_gib": 61.0, "plan_over_measured": 0.754}},
     "the peaks do not fall"),
    ({"full": {"loss": 5.1}}, "the modes' losses differ"),
], ids=["pass", "slower", "plan off", "peaks", "loss"])
def test_the_verdict_fails_on_what_would_make_auto_choose_wrong(case, says):
    verdict = modes_verdict(result(**case))
    assert verdict["status"] == ("PASS" if says is None else "FAIL"), verdict["summary"]
    assert says is None or says in verdict["summary"]
    assert "selective x1.05, full x1.3 of off" in modes_verdict(result())["summary"]


def test_the_compiled_layers_check_runs_on_cpu(tiny_targets):
    """measure_compiled at a tiny size (sdpa, float32, aot_eager): eager's loss, a first step that compiles, nothing
    compiled after it."""
    out = measure_compiled(torch.device("cpu"), TINY, repeat=1, backend="aot_eager", other_length=256)
    verdict = compiled_verdict(out)
    assert verdict["status"] == "PASS", verdict["summary"]
    assert out["first_step_compiled"]["graphs"] > 0 and out["eager_over_compiled"] > 0


@pytest.mark.parametrize("case, says", [
    ({}, None),
    ({"loss": 5.2}, "the compiled step's loss 5.20000 is not eager's 5.00000"),
    ({"timed_steps_compiled": {"graphs": 1, "recompiles": 1}}, "the timed steps compiled again"),
    ({"other_length_compiled": {"graphs": 2, "recompiles": 2}},
     "a step of 3000 tokens (the same padded shape) compiled"),
    ({"first_step_compiled": {"graphs": 0, "recompiles": 0}}, "the first compiled step compiled no graph"),
], ids=["pass", "loss", "timed", "other length", "nothing compiled"])
def test_the_compiled_verdict(case, says):
    out = {"shape": "experiment=qwen3_6_27b", "eager_s": 0.6, "compiled_s": 0.45, "first_compiled_s": 50.0,
           "eager_over_compiled": 1.333, "loss": 5.0, "eager_loss": 5.0, "first_step_compiled": {"graphs": 2,
           "recompiles": 1}, "timed_steps_compiled": {"graphs": 0, "recompiles": 0}, "other_length": 3000,
           "other_length_compiled": {"graphs": 0, "recompiles": 0}, "recompile_reasons": [], **case}
    verdict = compiled_verdict(out)
    assert verdict["status"] == ("PASS" if says is None else "FAIL"), verdict["summary"]
    assert says is None or says in verdict["summary"]
    assert "(x1.333 faster)" in verdict["summary"]
