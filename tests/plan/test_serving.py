"""dflash.plan.serving: what a drafter buys at a concurrency, the model bench/serving.py checks against vLLM."""

import json

import pytest

from dflash.errors import ConfigError
from dflash.plan import serving as model
from dflash.plan.configured import read_tau
from dflash.plan.report import main


def costs(tpot=1.0, ttft=0.0, decode=1.0, verify=1.0, drafter=0.0, spec_step=None, admission=0.0, clean=None,
          cs=(1, 8)):
    base = model.Baseline(ttft={c: ttft for c in cs}, tpot={c: tpot for c in cs})
    fw = model.Forwards(target_decode={c: decode for c in cs}, target_verify={c: verify for c in cs},
                        drafter={c: drafter for c in cs}, spec_step=spec_step or {},
                        admission={c: admission for c in cs}, clean_decode=clean or {})
    return base, fw


def test_speedup_is_tau_when_verifying_costs_a_decode_step_and_drafting_nothing():
    base, fw = costs()
    assert model.speedup(1, 3.0, 101, base, fw) == pytest.approx(3.0)
    # the engine's overhead besides the forward (tpot - decode) is paid by both steps
    base, fw = costs(tpot=2.0, decode=1.0, verify=3.0, drafter=1.0)
    assert model.decode_step(1, base, fw) == pytest.approx(1.0 + 3.0 + 1.0)
    assert model.speedup(1, 5.0, 101, base, fw) == pytest.approx(100 * 2.0 / (1.0 + 100 / 5.0 * 5.0))
    # the first token (prefill) is not sped up, and the drafter's first pass adds to it
    base, fw = costs(ttft=10.0, drafter=0.5)
    assert model.speedup(1, 2.0, 11, base, fw) == pytest.approx((10 + 10) / (10 + 0.5 + 10 / 2 * 1.5))
    with pytest.raises(ValueError, match="at least 1"):
        model.speedup(1, 0.5, 11, base, fw)


def test_a_timed_speculative_step_replaces_overhead_plus_forwards():
    base, fw = costs(tpot=2.0, decode=1.0, verify=3.0, drafter=1.0, spec_step={8: 9.0})
    assert model.decode_step(8, base, fw) == 9.0
    assert model.decode_step(1, base, fw) == 5.0


def test_requests_end_tau_times_sooner_so_a_step_admits_tau_times_as_many():
    # 8 requests of 41 tokens: a step admits 8 / 40 of a request without the drafter, tau times that with it
    base, fw = costs(spec_step={8: 9.0}, admission=2.0)
    assert model.spec_step(8, base, fw, tau=4.0, tokens=41) == pytest.approx(9.0 + 2.0 * 8 * 4.0 / 40)
    assert model.speedup(8, 4.0, 41, base, fw) == pytest.approx(40 * 1.0 / (40 / 4.0 * (9.0 + 1.6)))


def test_what_serving_adds_per_token_is_paid_for_every_token_a_speculative_step_hands_over():
    # vLLM's CPU sweep of 2026-12-05 at C = 1, greedy: the target alone served at 4.7 ms a token where its clean step
    # was timed at 3.4 ms; the drafter's clean step 5.6 ms, tau 3.37, 48 tokens a request. Served, the drafter's
    # step took 9.9 ms (its tpot x acceptance) and the ratio was 1.50: the clean step alone predicted 2.45
    base, fw = costs(tpot=4.7e-3, ttft=12.2e-3, spec_step={1: 5.6e-3}, clean={1: 3.4e-3})
    assert model.served(1, base, fw) == pytest.approx(1.3e-3)
    assert model.spec_step(1, base, fw, tau=3.37, tokens=48) == pytest.approx(5.6e-3 + 3.37 * 1.3e-3)
    assert model.speedup(1, 3.37, 48, base, fw) == pytest.approx(1.50, rel=0.05)
    # none where the clean step was not timed (the roofline: its overhead is per step, in decode_step), and never
    # negative where the served tpot reads below the clean step
    assert model.served(8, base, fw) == 0.0
    assert model.served(1, *costs(tpot=3.0e-3, clean={1: 3.4e-3})) == 0.0
    # needed_tau still inverts speedup with the served term
    base, fw = costs(tpot=2.0, ttft=5.0, decode=1.0, verify=1.5, drafter=0.2, clean={1: 1.6})
    tau = model.needed_tau(1, 1.2, 200, 16, base, fw)
    assert model.speedup(1, tau, 200, base, fw) == pytest.approx(1.2)
    # and with arrivals admitted: 8 requests, 2 s an admission
    base, fw = costs(tpot=2.0, ttft=5.0, decode=1.0, verify=1.5, drafter=0.2, admission=2.0, clean={8: 1.6})
    tau = model.needed_tau(8, 1.1, 41, 16, base, fw)
    assert model.speedup(8, tau, 41, base, fw) == pytest.approx(1.1)


def test_crossing_is_the_first_concurrency_below_one():
    assert model.crossing({1: 2.0, 2: 1.4, 4: 0.9, 8: 1.1}) == 4
    assert model.crossing({1: 2.0, 8: 1.0}) is None


def test_needed_tau_inverts_speedup_and_says_when_no_tau_reaches_the_goal():
    base, fw = costs(tpot=2.0, ttft=5.0, decode=1.5, verify=3.0, drafter=0.4, admission=0.3)
    for goal in (1.0, 1.5, 2.5):
        tau = model.needed_tau(1, goal, 200, 16, base, fw)
        assert model.speedup(1, tau, 200, base, fw) == pytest.approx(goal)
    assert model.needed_tau(1, 3.0, 200, 4, base, fw) is None  # past every draft of a block of 4 accepted


def test_the_roofline_is_memory_bound_at_low_concurrency_and_compute_bound_at_high():
    gpu = model.GPUS["h200"]
    m = model.Model(flop_params=8e9, weight_bytes=16e9, kv_bytes_per_token=144e3)
    one, sixteen = model.forward_seconds(m, gpu, 1, 1, 1024), model.forward_seconds(m, gpu, 1, 16, 1024)
    assert sixteen == pytest.approx(one)  # 16 tokens read the same weights: verifying a block is free at C = 1
    wide = model.forward_seconds(m, gpu, 64, 16, 1024)
    assert wide == pytest.approx(2 * 8e9 * 64 * 16 / (gpu.tflops * 1e12 * gpu.flops_efficiency) + gpu.launch_s)
    assert model.forward_seconds(m, gpu, 64, 1, 4096) > model.forward_seconds(m, gpu, 64, 1, 1024)  # KV reads


def test_read_tau_from_a_number_a_summary_and_the_published_references(tmp_path):
    assert read_tau("6.5", "Qwen/Qwen3-8B", 16) == (6.5, "given as tau=")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"metrics": {"eval/live_tau": 4.25, "eval/tau": 4.0}}))
    assert read_tau(str(summary), "Qwen/Qwen3-8B", 16)[0] == 4.25
    tau, where = read_tau("dflash_paper:gsm8k", "Qwen/Qwen3-8B", 16)
    assert tau == 6.55 and "z-lab Qwen3-8B-DFlash-b16" in where and "bb48ef9" in where
    with pytest.raises(ConfigError, match="block size 8"):
        read_tau("dflash_paper:gsm8k", "Qwen/Qwen3-8B", 8)
    with pytest.raises(ConfigError, match="no such file"):
        read_tau(str(tmp_path / "missing.json"), "Qwen/Qwen3-8B", 16)


def test_the_plan_command_prints_the_speedup_by_concurrency_and_what_other_shapes_need(capsys, caplog):
    main(["experiment=qwen3_8b", "concurrency=[1,8,32]", "tau=dflash_paper:gsm8k", "--json"])
    out = json.loads(capsys.readouterr().out)
    speedup = [out["speedup"][str(c)] for c in (1, 8, 32)]
    assert speedup[0] > speedup[1] > speedup[2] > 1  # a bigger batch leaves less idle compute to verify with
    assert out["tau"] == 6.55 and out["gpu"] == "H200 SXM"
    configured = [s for s in out["shapes"] if (s["block_size"], s["layers"], s["budget"]) == (16, 5, None)]
    assert all(t == pytest.approx(6.55) for t in configured[0]["needed_tau"].values())
    block8 = next(s for s in out["shapes"] if (s["block_size"], s["layers"], s["budget"]) == (8, 5, None))
    assert block8["needed_tau"]["32"] < 6.55  # at C = 32 a shorter block matches it with less acceptance
    main(["experiment=qwen3_8b", "concurrency=[1,32]"])
    text = capsys.readouterr().out
    assert "no tau given" in text and "break-even" in text and "a model, not a measurement" in text
    with pytest.raises(SystemExit):
        main(["experiment=qwen3_8b", "concurrency=[1]", "gpu=tpu"])
    assert "gpu=tpu: one of h200, h100, a100" in caplog.text


def test_gemma4s_kv_cache_counts_each_layers_own_heads_and_the_plan_serves_it(capsys):
    """Gemma 4's layers differ in KV heads and head width (50 sliding layers of 16 x 256, 10 full of 4 x 512 in the
    31B); its config refuses the global attribute the model read (the plan raised AmbiguousGlobalPerLayerAttributeError)."""
    from dflash.plan.configured import target_config
    from tests.conftest import compose

    text = target_config(compose("train", ["experiment=gemma4_31b_it", "data.prompts=x"]).target)
    sliding, full = 50 * 2 * 2 * 16 * 256, 10 * 2 * 2 * 4 * 512  # bf16 K and V of one token, per layer kind
    assert model.kv_bytes_per_token(text, 1024) == sliding + full  # the window (1024) covers the context
    assert model.kv_bytes_per_token(text, 4096) == sliding / 4 + full  # a sliding layer keeps its last 1024
    main(["experiment=gemma4_31b_it", "concurrency=[1,32]", "tau=4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["speedup"]["1"] > out["speedup"]["32"] > 1


@pytest.mark.parametrize("tau", ["20", "0.5", "16.5"])
def test_a_tau_the_configured_block_cannot_keep_is_refused_in_one_line(tau, capsys, caplog):
    """tau=20 for a block of 16 printed "speedup at tau 20.00" beside the figure of tau 16 (the model clipped it to
    the block); a tau below 1 (less than the target's own token) is as impossible. Both stop, naming tau= and the
    limits; the edges themselves are fine."""
    with pytest.raises(SystemExit):
        main(["experiment=qwen3_8b", "concurrency=[1]", f"tau={tau}"])
    assert capsys.readouterr().out == ""  # nothing printed at a tau the model did not use
    assert f"tau={tau}: {float(tau):g} is outside [1, 16]" in caplog.text and "drafter.block_size=16" in caplog.text
    main(["experiment=qwen3_8b", "concurrency=[1]", "tau=16", "--json"])
    assert json.loads(capsys.readouterr().out)["tau"] == 16.0


def test_eval_serving_gpu_is_checked_against_the_serving_models_gpus():
    """dflash.config checks eval.serving.gpu without importing the plan (config sits below it): against its own
    SERVING_GPUS, the names GPUS is keyed by (the module refuses to import where the two differ)."""
    from dflash.config.run import SERVING_GPUS
    from tests.conftest import compose

    assert tuple(model.GPUS) == SERVING_GPUS
    with pytest.raises(Exception, match="eval.serving.gpu='tpu' is not valid"):
        compose("evaluate", ["debug=tiny", "eval.serving.gpu=tpu"])
