"""The GPU check (bench/gpu_check.sh, bench/gpu/checks.py, bench/gpu/runner.py) run on a CPU machine: its
GPU checks SKIP there, the others run small; what it projects, counts, keeps when killed, and judges."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_gpu_check_runs_on_a_cpu_machine_and_says_what_it_skipped(tmp_path):
    """bash bench/gpu_check.sh on a CPU machine, with wandb made unimportable (no check may need it): a
    line per check with PASS/FAIL/SKIP and a reason, and a complete report."""
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the check takes minutes: run bash bench/gpu_check.sh")
    blocker = tmp_path / "no_wandb" / "wandb"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('wandb is blocked: no GPU check may need it')\n")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, GPU_CHECK_RESULTS=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(blocker.parent)] + [p for p in [env.get("PYTHONPATH")] if p]))
    run = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("flex_train_step", "qwen3_6_step", "gpu_tests", "fla_kernels", "qwen3_6_dflash2_step",
                 "vllm_dflash2", "sharded_extraction", "serving_sweep", "checkpointing_modes", "compiled_layers"):
        assert any(line.startswith(f"SKIP {name} needs CUDA") for line in lines), run.stdout
    for name in ("install", "autocast_loss", "live_lossless"):
        assert any(line.startswith(f"PASS {name} ") for line in lines), run.stdout
    [path] = tmp_path.glob("*-gpu-check.json")
    report = json.loads(path.read_text())
    assert report["summary"] == {"PASS": 3, "FAIL": 0, "SKIP": 10} and report["complete"] and not report["pending"]
    assert report["checks"]["live_lossless"]["runs"] and report["checks"]["autocast_loss"]["loss_rel_diff"] < 1e-2


# --- the GPU check itself, on CPU: what it projects, counts, keeps when killed, and judges ---

def test_flex_lengths_run_the_recipe_first_and_project_a_compile_from_the_last_one():
    """A 72 s cold compile at 3072 (the first length) must not end the check: the next new shape is
    projected from that compile (paid once, not 1.5x the whole first length as before), a length of a
    compiled shape costs no compile, and once a warm compile is measured it is what is projected."""
    from bench.gpu.checks import FLEX_LENGTHS
    from bench.gpu.steps import next_cost
    from bench.gpu.verdicts import RECIPE_LENGTH
    from dflash.tiling import flex_padded_shape

    assert FLEX_LENGTHS[:2] == [RECIPE_LENGTH, 4096]
    shapes = [flex_padded_shape(L, 512, 512) for L in FLEX_LENGTHS]
    assert shapes[2] == shapes[0]  # the third length reuses the recipe's graph: reuse is checked early
    measured = {3072: {"step_s": 0.5, "first_step_s": 72.0, "new_shape": True}}
    assert next_cost(3072, True, {}, 3) == 0.0  # the first length always runs
    assert next_cost(4096, False, measured, 3) == pytest.approx(72 + 3 * 0.5 * 4096 / 3072)
    assert next_cost(3000, True, measured, 3) == pytest.approx(4 * 0.5 * 3000 / 3072)
    spent = 72 + 3 * 0.5
    assert spent + next_cost(4096, False, measured, 3) < 180  # fits a 180 s budget (the old rule stopped here)
    measured[4096] = {"step_s": 0.8, "first_step_s": 20.0, "new_shape": True}
    measured[3000] = {"step_s": 0.49, "first_step_s": 0.5, "new_shape": False}
    assert next_cost(2048, False, measured, 3) == pytest.approx(20 + 3 * 0.8 * 2048 / 4096)  # the slowest per token


def test_flex_lengths_skip_what_does_not_fit_and_go_on(monkeypatch):
    """A length over the budget is skipped, not the end: later lengths of compiled shapes still run."""
    from bench.gpu import steps

    monkeypatch.setattr(steps, "next_cost", lambda L, compiled, measured, repeat: 0.0 if compiled else 1e9)
    out = steps.flex_lengths([300, 600, 290], 16, 100, torch.device("cpu"), dims=steps.SMALL, repeat=1,
                           backend="sdpa")
    assert list(out["lengths"]) == [300, 290] and list(out["skipped"]) == [600]
    assert out["lengths"][300]["new_shape"] and not out["lengths"][290]["new_shape"]


def test_compile_watch_counts_dynamo_graphs_and_recompiles():
    from bench.gpu.steps import CompileWatch

    torch._dynamo.reset()  # no graphs of earlier tests for the same code
    f = torch.compile(lambda x: x * 3 + 1, backend="eager", dynamic=False)
    with CompileWatch() as watch:
        f(torch.ones(3))
        first = watch.mark()
        f(torch.ones(3))
        same = watch.mark()
        f(torch.ones(5))
        other = watch.mark()
    assert first["graphs"] == 1 and first["recompiles"] == 0 and same == first
    assert other["graphs"] == 2 and other["recompiles"] == 1 and "size mismatch" in watch.recompiles[0]


@pytest.mark.parametrize("keyed_on", ["padded shape", "exact length"])
def test_flex_check_fails_when_a_compiled_shape_recompiles(monkeypatch, keyed_on):
    """Dynamo's own counts decide: a step that compiles for each exact length recompiles at 290, whose
    padded shape 300 compiled already, and the check FAILs; keyed on the padded shape it PASSes. (The
    old check compared dflash's flex count with the number of shapes it is keyed on: always equal.)"""
    from bench.gpu import steps
    from bench.gpu.checks import flex_verdict
    from dflash.tiling import flex_padded_shape

    torch._dynamo.reset()  # the lambda's code is the same in both cases: start without its graphs
    compiled = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    original = steps.loss_and_backward

    def step(drafter, embed, head_weight, feats, blocks, *args, **kwargs):
        n = feats.shape[1] if keyed_on == "exact length" else flex_padded_shape(feats.shape[1], 16, 16)[0]
        compiled(torch.zeros(n))
        return original(drafter, embed, head_weight, feats, blocks, *args, **kwargs)

    monkeypatch.setattr(steps, "loss_and_backward", step)
    out = steps.flex_lengths([300, 290], 16, 100, torch.device("cpu"), dims=steps.SMALL, repeat=1, backend="sdpa")
    verdict = flex_verdict(out, recipe=300)
    if keyed_on == "exact length":
        assert verdict["status"] == "FAIL" and "recompiled a compiled shape: 290" in verdict["summary"]
        assert out["lengths"][290]["first_step_compiled"] == {"graphs": 1, "recompiles": 1}
    else:
        assert verdict["status"] == "PASS", verdict["summary"]
        assert out["compiles"]["dynamo_graphs"] == 1 and "1 reused (290)" in verdict["summary"]


def fake_pass(budget):
    return {"status": "PASS", "summary": "a fake check"}


def fake_pass_too(budget):
    return {"status": "PASS", "summary": "another fake check"}


class _Slow:
    """Turns into JSON slowly (json.dump calls default=str on it), so a kill lands inside a write."""

    def __str__(self):
        time.sleep(0.5)
        return "slow"


def fake_killed_mid_write(budget):
    from bench.gpu.runner import save_partial

    save_partial({"lengths": {3072: {"step_s": 0.5}}})  # what a first length leaves
    save_partial({"lengths": {3072: {"step_s": 0.5}, 4096: {"step_s": 0.7}}, "zz": [_Slow() for _ in range(200)]})
    return {"status": "PASS", "summary": "never reached"}


# the time limits leave the check's process about 3x what it needs to start and write its first partial (2.3 s on
# 2 CPU cores); the write it is killed in lasts 100 s, the broken check sleeps 60
fake_killed_mid_write.timeout_s = 8


def fake_broken_partial(budget):
    """A partial file as a non-atomic writer killed mid-write leaves it."""
    Path(os.environ["GPU_CHECK_PARTIAL"]).write_text('{"status": "FAIL", "lengths": {"3072": {"step_')
    time.sleep(60)


fake_broken_partial.timeout_s = 7


def fake_sleeps(budget):
    from bench.gpu.runner import save_partial

    save_partial({"pid": os.getpid()})
    time.sleep(120)


fake_sleeps.timeout_s = 150


def fake_autotunes(budget):
    """What a check that runs fla's kernels prints under TRITON_PRINT_AUTOTUNING=1 (Triton 3.4+, and before 3.3)."""
    print("Triton autotuning for function l2norm_fwd_kernel,\nwith key as (16, 1, 'torch.bfloat16', 'torch.float32'),"
          "\nfinished after 7.41s,\nbest config selected: BD: 32, num_warps: 4;")
    print("Autotuning kernel chunk_fwd_kernel_o with config BK: 64, num_warps: 4")
    print("Triton autotuning for function chunk_fwd_kernel_o finished after 2.56s; best config selected: BK: 64;")
    return {"status": "PASS", "summary": "autotuned twice"}


def test_the_report_records_at_run_time_what_ran_and_how(tmp_path, monkeypatch):
    """Everything a report holds is written by the runner while it runs: the start, the commit, the command, the
    waves and which checks had the machine alone, the Triton cache directory and its autotuning results before
    and after, and per check the autotunings its log shows. A second run the same day writes a report of its own
    (-2) and leaves the first as it was."""
    from bench.gpu.checks import main
    from bench.run import _machine_tag, machine
    from dflash.tracking import git_commit

    if torch.cuda.is_available():
        pytest.skip("the fake checks run one by one on CPU only")
    for k, v in {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("OUT", "GPU_CHECK_INSTALL", "TRITON_PRINT_AUTOTUNING"):
        monkeypatch.delenv(k, raising=False)
    cache = tmp_path / "triton"
    (cache / "3f2a").mkdir(parents=True)
    (cache / "3f2a" / "l2norm_fwd_kernel.autotune.json").write_text("{}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    inductor = tmp_path / "inductor"
    (inductor / "fx").mkdir(parents=True)
    (inductor / "fx" / "graph").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    results = tmp_path / "results"
    results.mkdir()
    earlier = results / f"{time.strftime('%Y-%m-%d')}-{_machine_tag(machine())}-gpu-check.json"
    earlier.write_text('{"checks": {}}')
    names = ["tests.bench.gpu.test_checks:fake_autotunes", "tests.bench.gpu.test_checks:fake_pass"]
    assert main(["--only", *names, "--results", str(results)]) == 0
    assert earlier.read_text() == '{"checks": {}}'
    report = json.loads(earlier.with_name(earlier.stem + "-2.json").read_text())
    assert report["command"] == f"python -m bench.gpu.checks --only {' '.join(names)} --results {results}"
    assert report["commit"] == git_commit() and report["started"].startswith(report["date"])
    assert report["device"] == "cpu" and report["waves"] == [[n] for n in names]
    assert all(report["checks"][n]["alone"] for n in names)
    assert report["triton_cache"] == {"dir": str(cache), "autotune_results_before": 1, "autotune_results_after": 1}
    assert report["inductor_cache"] == {"dir": str(inductor), "files_before": 1, "files_after": 1}
    tuned = report["checks"][names[0]]["triton_autotuning"]
    assert (tuned["count"], tuned["seconds"]) == (2, 9.97)
    assert tuned["runs"] == [
        {"kernel": "l2norm_fwd_kernel", "key": "(16, 1, 'torch.bfloat16', 'torch.float32')", "seconds": 7.41},
        {"kernel": "chunk_fwd_kernel_o", "key": None, "seconds": 2.56}]
    assert report["checks"][names[1]]["triton_autotuning"] == {"count": 0, "seconds": 0, "runs": []}


def test_a_broken_result_file_is_noted_not_fatal(tmp_path):
    from bench.gpu.runner import read_result

    (tmp_path / "a.json").write_text('{"status": "PASS", "summ')
    (tmp_path / "b.json").write_text("[1, 2]")
    assert read_result(tmp_path / "none.json") == (None, None)
    obj, note = read_result(tmp_path / "a.json")
    assert obj is None and "a.json unreadable (JSONDecodeError" in note and note.endswith("skipped")
    assert read_result(tmp_path / "b.json")[0] is None


@pytest.mark.slow
def test_a_check_killed_mid_write_loses_nothing_but_itself(tmp_path, monkeypatch):
    """A check SIGKILLed inside a write of its partial result (the temp file is left half-written) keeps the
    partial it wrote before; a broken partial file is skipped with a note; the checks before and after
    are in the report, which was rewritten after each."""
    from bench.gpu.checks import run_plan
    from bench.gpu.runner import run_all

    if torch.cuda.is_available():
        pytest.skip("the fake checks run one by one on CPU only")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.delenv("GPU_CHECK_INSTALL", raising=False)
    names = [f"tests.bench.gpu.test_checks:{n}" for n in ("fake_pass", "fake_killed_mid_write", "fake_broken_partial",
                                              "fake_pass_too")]
    report = run_all(names, 300, tmp_path / "results", run_plan(names))
    checks = report["checks"]
    assert [checks[n]["status"] for n in names] == ["PASS", "FAIL", "FAIL", "PASS"]
    assert all(checks[n]["alone"] for n in names)  # on CPU one by one: each had the machine to itself
    killed, broken = checks[names[1]], checks[names[2]]
    assert killed["summary"].startswith("timed out after 8 s") and killed["lengths"] == {"3072": {"step_s": 0.5}}
    logs = tmp_path / "out" / "gpu-check-logs"
    # killed inside the write
    assert (logs / ".tests.bench.gpu.test_checks-fake_killed_mid_write.partial.json.tmp").exists()
    assert "partial.json unreadable (JSONDecodeError" in broken["summary"] and "skipped" in broken["summary"]
    [path] = (tmp_path / "results").glob("*-gpu-check.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(report, default=str))
    assert report["complete"] and report["summary"] == {"PASS": 2, "FAIL": 2, "SKIP": 0}


@pytest.mark.slow
def test_a_killed_run_leaves_the_checks_it_finished(tmp_path):
    """SIGKILL the whole run while its second check runs: the report on disk has the first check,
    complete false and the second one pending."""
    if torch.cuda.is_available():
        pytest.skip("the fake checks run one by one on CPU only")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    env.pop("GPU_CHECK_INSTALL", None)
    names = ["tests.bench.gpu.test_checks:fake_pass", "tests.bench.gpu.test_checks:fake_sleeps"]
    run = subprocess.Popen([sys.executable, "-m", "bench.gpu.checks", "--only", *names, "--results",
                            str(tmp_path / "results")], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    partial = tmp_path / "out" / "gpu-check-logs" / "tests.bench.gpu.test_checks-fake_sleeps.partial.json"
    deadline = time.time() + 120
    while not partial.exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.5)
    child = json.loads(partial.read_text())["pid"]
    run.kill()
    run.wait()
    os.kill(child, 9)  # the check runs in a session of its own: end it too
    [path] = (tmp_path / "results").glob("*-gpu-check.json")
    report = json.loads(path.read_text())
    assert report["checks"][names[0]]["status"] == "PASS" and not report["complete"]
    assert report["pending"] == [names[1]] and (tmp_path / "out" / path.name).exists()


def test_the_qwen3_6_preset_is_the_published_drafter_at_the_recipe_shape():
    """What qwen3_6_step runs on a GPU (built here on the meta device): 24 query / 4 key-value heads of
    256, four sliding layers of 2048 and one full, block 16, 3072 tokens, 512 anchors, flex, bf16."""
    from bench.gpu.steps import QWEN3_6_PRESET, preset_job

    job, shape, setup = preset_job(QWEN3_6_PRESET)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.layers, shape.block_size) == (24, 4, 256, 5, 16)
    assert job["drafter"].resolved_layer_types() == ["sliding_attention"] * 4 + ["full_attention"]
    assert job["drafter"].sliding_window == 2048
    assert (setup.ctx_len, setup.num_anchors, setup.backend, setup.compute, setup.batch) == (3072, 512, "flex", 2, 1)
    assert setup.allowance == 0 and setup.fragmentation == 0 and not setup.online


def test_the_dflash2_preset_is_the_published_27b_dflash2_drafter():
    """What qwen3_6_dflash2_step runs on a GPU: five non-causal sliding layers of 2048, block 8, the convolutions
    and a top-16 rank-256 selector, at the DFlash recipe's 3072 tokens and 512 anchors."""
    from bench.gpu.steps import QWEN3_6_DFLASH2_PRESET, preset_job

    job, shape, setup = preset_job(QWEN3_6_DFLASH2_PRESET)
    assert (shape.layers, shape.block_size, shape.dflash2, shape.selector_rank, shape.selector_top_k) == (
        5, 8, True, 256, 16)
    assert job["drafter"].resolved_layer_types() == ["sliding_attention"] * 5
    assert not job["drafter"].resolved_sliding_causal() and job["drafter"].sliding_window == 2048
    assert (setup.ctx_len, setup.num_anchors, setup.backend) == (3072, 512, "flex")


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_preset_step_runs_on_cpu_and_its_peak_meets_the_plan(tiny_targets, kind):
    """The qwen3_6_step code path at a tiny size (sdpa, a sliding and a full layer, float32 on CPU), and the
    DFlash 2 check's: it reports its figures, and the plan's estimate is within 15% of the tensors TensorPeak
    counts."""
    from bench.gpu.checks import preset_verdict
    from bench.gpu.steps import preset_step

    out = preset_step(torch.device("cpu"), [
        "target=tiny_qwen3", "drafter=tiny", "drafter.layer_types=[sliding_attention,full_attention]",
        "drafter.sliding_window=64", "train.attention=sdpa", "train.mixed_precision=no", "train.num_anchors=24",
        "data.max_length=256", f"drafter.kind={kind}", "drafter.selector_rank=32"], repeat=1)
    verdict = preset_verdict(out)
    print(verdict["summary"])
    assert verdict["status"] == "PASS", verdict["summary"]
    assert out["mask_kinds"] == 2 and out["context_tokens_per_s"] > 0 and out["mfu"] is None
    assert out["conv_kernel"] == ("torch" if kind == "dflash2" else "auto")  # no convolution in DFlash
    assert out["timed_steps_compiled"] == {"graphs": 0, "recompiles": 0}
    assert abs(out["plan_over_measured"] - 1) <= 0.15
    # the forward and backward alone: below the whole step's peak, within 15% of the plan's, rise included
    assert out["activation_peak_gib"] <= out["peak_memory_gib"] and out["plan_activation_phase"] != "optimizer step"
    assert abs(out["plan_activation_over_measured"] - 1) <= 0.15
    assert abs(out["plan_activation_rise_over_measured"] - 1) <= 0.15
    wrong = preset_verdict({**out, "plan_over_measured": 1.2, "backend": "flex"})
    assert "1.200x the measured" in wrong["summary"] and "flex ran uncompiled" in wrong["summary"]


@pytest.mark.parametrize("conv", ["equal", "unequal", "raises"])
def test_the_dflash2_step_trains_with_the_triton_convolution_only_where_it_is_equal(monkeypatch, conv):
    """qwen3_6_dflash2_step compares and times the Triton convolution first (bench.dflash2_conv.conv_on_gpu); the
    step trains with it where it is equal, else with train.conv_kernel=torch, and the check then fails saying why
    (a kernel that does not even run costs the check's verdict, not the step's figures)."""
    from bench import dflash2_conv
    from bench.gpu import checks, steps

    row = {"ok": conv == "equal", "kernel_vs_float32": {"out": 0.5}}
    found = {"ok": conv == "equal", "compared": {"bfloat16": row}, "fwd_bwd_ms": {"torch": 3.0, "triton": 1.0},
             "torch_over_triton": 3.0}

    def conv_on_gpu(device):
        if conv == "raises":
            raise RuntimeError("PassManager::run failed")
        return found

    ran = []
    monkeypatch.setattr(checks, "_cuda", lambda: torch.device("cuda"))
    monkeypatch.setattr(dflash2_conv, "conv_on_gpu", conv_on_gpu)
    monkeypatch.setattr(steps, "preset_step",
                        lambda device, overrides, budget_s: ran.append(overrides) or _preset_out())
    out = checks.qwen3_6_dflash2_step(100)
    assert ran[0][:len(steps.QWEN3_6_DFLASH2_PRESET)] == steps.QWEN3_6_DFLASH2_PRESET
    if conv == "equal":
        assert out["status"] == "PASS" and ran[0] == steps.QWEN3_6_DFLASH2_PRESET, out["summary"]
        assert "fwd+bwd 1.0 ms against 3.0 ms (x3.0)" in out["summary"]
    else:
        assert out["status"] == "FAIL" and ran[0][-1] == "train.conv_kernel=torch"
        assert ("PassManager::run failed" if conv == "raises" else "bfloat16: {'out': 0.5}") in out["summary"]


def _preset_out(**figures) -> dict:
    """A preset_step result as the Qwen3.6-27B step's on the first H200 (peaks in GiB), with `figures` changed."""
    out = {"shape": "experiment=qwen3_6_27b train.mode=offline: drafter", "backend": "flex", "checkpointing": True,
           "mask_kinds": 2, "context_tokens_per_s": 6736.3, "block_tokens_per_s": 17963.5, "tflops": 284.0,
           "mfu": 0.287, "first_step_s": 19.45, "first_step_compiled": {"graphs": 2, "recompiles": 1},
           "timed_steps_compiled": {"graphs": 0, "recompiles": 0}, "recompile_limit_hits": [],
           "recompile_reasons": [], "peak_memory_gib": 39.275, "plan_peak_gib": 39.21, "plan_phase": "optimizer step",
           "plan_over_measured": 0.998, "activation_peak_gib": 35.9, "plan_activation_peak_gib": 35.85,
           "plan_activation_phase": "drafter layers", "plan_activation_over_measured": 0.999,
           "activation_rise_gib": 10.3, "plan_activation_rise_over_measured": 1.0}
    return {**out, **figures}


@pytest.mark.parametrize("case", ["as planned", "within 15%", "activations 2.5x the plan", "plan 2.5x the activations"])
def test_the_preset_check_fails_when_the_activation_phases_are_off(case):
    """The step's peak is the optimizer's (its parameters, gradients, AdamW state and foreach temporary), so the
    plan's activations could be 2.5x off and the whole step's peak still match (x0.998 here): the check also
    holds the forward and backward's own peak, and its rise over the step's start, to the plan within 15%."""
    from bench.gpu.checks import preset_verdict

    rise = 10.3  # GiB the forward and backward add over the 25.5 GiB the step starts with (plan: 35.85 - 25.54)
    measured = {"as planned": rise, "within 15%": rise * 1.13, "activations 2.5x the plan": rise * 2.5,
                "plan 2.5x the activations": max(rise / 2.5, 6.8)}[case]  # 6.8: the gradients at the end of backward
    out = _preset_out(activation_peak_gib=25.54 + measured, activation_rise_gib=measured,
                      plan_activation_over_measured=round(35.85 / (25.54 + measured), 3),
                      plan_activation_rise_over_measured=round(rise / measured, 3))
    verdict = preset_verdict(out)
    assert out["plan_over_measured"] == 0.998  # the whole step's peak matches in every case
    if case in ("as planned", "within 15%"):
        assert verdict["status"] == "PASS", verdict["summary"]
    else:
        assert verdict["status"] == "FAIL" and "correct the plan's activation terms" in verdict["summary"]


def test_extraction_kernels_run_at_the_real_head_dims_on_cpu():
    """The fla check's code path with the mid-size hybrid (head dims 128 and 256) on CPU, where the
    fallback is what is bound: bound and fallback agree exactly in bf16 and float32, and the verdict
    names the kernels and says fla is not bound."""
    from bench.gpu.checks import kernel_verdict
    from bench.gpu.target import extraction_kernels, mid_hybrid_config

    out = extraction_kernels(torch.device("cpu"), mid_hybrid_config(vocab_size=512), batch=1, length=64, repeat=1)
    assert out["kernels"]["linear_attention"] == "torch_fallback"
    assert out["features_max_abs_diff"] == 0 and out["features_max_abs_diff_float32"] == 0
    assert out["deltanet_bound_float32_err_max"] == 0 < out["deltanet_fallback_err_max"]
    why, figures = kernel_verdict(out, "head dims 128")
    assert why == [next(w for w in why if "fla is not bound" in w)]
    assert "linear heads 4/12 x 128" in figures and "bf16 0, float32 0" in figures


def _run(dtype, drafter="oracle", margin=None, target="toy", clear=0):
    div = None if margin is None else {"at": 7, "plain": [11], "spec": [12], "lengths": [32, 32], "margin": margin}
    first = [{"at": 20, "token": 40, "argmax": 41, "gap": 1.5, "top2_margin": 1.5}] * clear
    tokens = {"tokens": 32, "ties": 2, "non_ties": 30, "off_at_ties": int(margin is not None),
              "off_at_non_ties": clear, "clear": clear, "margin": 0.1, "first_clear": first}
    return {"target": target, "kernels": {}, "dtype": dtype, "prompt": "p", "drafter": drafter, "tree_budget": None,
            "identical": div is None, "divergence": div, "tokens": tokens, "tau": 3.0, "tokens_per_forward": 2.5,
            "verify_tokens": 90}


def test_lossless_is_exact_in_float32_and_bf16_divergences_are_listed_with_margins():
    from bench.gpu.checks import lossless_verdict

    ok = lossless_verdict({"runs": [_run("float32"), _run("bfloat16"), _run("bfloat16", "random", margin=0.03)]})
    assert ok["status"] == "PASS" and "bfloat16 1/2 identical" in ok["summary"]
    assert "toy/p/random at token 7 (plain [11], spec [12], margin 0.03)" in ok["summary"]
    # float32: a divergence fails even at a near-tie (the old check let 1e-3 pass as a tie)
    tie32 = lossless_verdict({"runs": [_run("float32", margin=1e-4), _run("bfloat16")]})
    assert tie32["status"] == "FAIL" and "float32: 1 runs differ" in tie32["summary"]
    clear = lossless_verdict({"runs": [_run("float32"), _run("bfloat16", margin=0.5)]})
    assert clear["status"] == "FAIL" and "clear logit margin" in clear["summary"]


def test_lossless_checks_every_committed_token_past_the_first_divergence():
    """A bf16 run that first departs from plain decoding at a tie (margin 0.03) and later commits a token 1.5 below
    the target's argmax over its own output FAILs (the old check stopped at the first divergence and passed it);
    the figures count every committed token, ties apart; a run without the token check FAILs."""
    from bench.gpu.checks import lossless_verdict

    runs = [_run("float32"), _run("bfloat16"), _run("bfloat16", "random", margin=0.03, clear=1)]
    verdict = lossless_verdict({"runs": runs})
    assert verdict["status"] == "FAIL", verdict["summary"]
    assert ("bfloat16: 1 committed tokens are not the target's argmax by a clear margin (>= 0.1): "
            "toy/p/random token 20 (40, argmax 41, 1.5 below it)") in verdict["summary"]
    assert "64 tokens, 60 non-ties (1 not the argmax), 4 ties (top-2 margin < 0.1; 1 not the argmax)" in verdict[
        "summary"]
    unchecked = {k: v for k, v in _run("bfloat16").items() if k != "tokens"}
    assert "1 runs were not checked token by token" in lossless_verdict({"runs": [_run("float32"), unchecked]})[
        "summary"]


def test_committed_tokens_are_each_the_targets_argmax_ties_apart():
    """Hand-made logits over a vocabulary of 4: committed tokens at the argmax pass; one a rounding apart from the
    top at a tie is counted, not failed; one 2.0 below the top at a clear position is a clear miss, wherever it is
    (after a tie included)."""
    from bench.gpu.verdicts import committed_tokens

    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0],   # token 0, clear
                           [2.0, 2.05, 0.0, 0.0],  # a tie (margin 0.05): 0 committed, 1 the argmax
                           [0.0, 0.0, 3.0, 1.0],   # token 2, clear
                           [0.0, 3.0, 1.0, 0.0]])  # token 1 is the argmax by 2.0: 2 committed
    out = committed_tokens([9, 9, 0, 0, 2, 2], 2, logits, 0.1)
    assert {k: out[k] for k in ("tokens", "ties", "non_ties", "off_at_ties", "off_at_non_ties", "clear")} == {
        "tokens": 4, "ties": 1, "non_ties": 3, "off_at_ties": 1, "off_at_non_ties": 1, "clear": 1}
    assert out["first_clear"] == [{"at": 3, "token": 2, "argmax": 1, "gap": 2.0, "top2_margin": 2.0}]
    assert committed_tokens([9, 9, 0, 1, 2, 1], 2, logits, 0.1)["clear"] == 0


def test_committed_tokens_of_a_tiny_targets_greedy_output(tiny_targets):
    """On a tiny Qwen3, greedy decoding's output passes against one batched forward over it; the same output with
    one token after the prompt replaced by one the target ranks far below fails at that token (and the ones after
    it see another context, so they are judged on it, as a speculative run's would be)."""
    from bench.gpu.verdicts import committed_tokens
    from dflash.drafter.decoding.engine import greedy_generate
    from dflash.target.features import target_forward

    target = tiny_targets["tiny_qwen3"]
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    out = greedy_generate(target, ids, 24)

    def check(output):
        with torch.no_grad():
            logits = target_forward(target, output, [], logits_to_keep=output.shape[1] - ids.shape[1] + 1).logits
        return committed_tokens(output[0].tolist(), ids.shape[1], logits[0, :-1], 1e-3)

    good = check(out)
    assert good["tokens"] == 24 and good["clear"] == 0 and good["ties"] + good["non_ties"] == 24
    with torch.no_grad():
        row = target_forward(target, out[:, :ids.shape[1] + 10], [], logits_to_keep=1).logits[0, -1]
    bad = out.clone()
    bad[0, ids.shape[1] + 10] = int(row.argmin())  # the token the target ranks last after that context
    broken = check(bad)
    assert broken["clear"] >= 1 and broken["first_clear"][0]["at"] == 10


def test_first_divergence_names_the_token_and_the_targets_margin(tiny_targets):
    from bench.gpu.target import first_divergence

    target = tiny_targets["tiny_qwen3"]
    plain = list(range(40, 60))
    assert first_divergence(target, plain, list(plain), 5) is None
    spec = plain[:12] + [99] + plain[13:]
    div = first_divergence(target, plain, spec, 5)
    assert div["at"] == 7 and div["plain"] == [52] and div["spec"] == [99] and div["margin"] >= 0
    assert first_divergence(target, plain, plain[:15], 5)["margin"] is None  # one output a prefix of the other


def test_no_check_imports_wandb():
    """The GPU machine has no wandb and the wheels bring none: every module the checks import, and the
    collection of the gpu-marked tests, work with wandb unimportable."""
    code = (
        "import sys; sys.modules['wandb'] = None\n"
        "import bench.gpu.checks, bench.gpu.steps, bench.gpu.target, bench.gpu.runner, bench.run, dflash.plan\n"
        "import dflash.tracking, dflash.train.loop, dflash.evaluate.live, dflash.drafter.decoding.engine\n"
        "import dflash.drafter.build, dflash.target.loading, dflash.target.builtin, dflash.train.optim\n"
        "import dflash.train.batches, tests.oracle\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--collect-only', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests']))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_wheels_leave_wandb_out_and_install_beside_the_environment():
    wheels = (REPO / "bench/prepare_wheels.sh").read_text()
    want = wheels[wheels.index('WANT="'):].split('"')[1]
    assert "hydra-core" in want and "flash-linear-attention" in want and "wandb" not in want
    script = (REPO / "bench/gpu_check.sh").read_text()
    assert "--target \"$SITE\"" in script and 'export PYTHONPATH="$SITE' in script
    assert "wandb:wandb" not in script


@pytest.mark.parametrize("case", ["pass", "off", "held", "refused"])
def test_the_sharded_extraction_check_judges_each_target_and_process(monkeypatch, case):
    """sharded_extraction (its probe faked): PASS when every process's features are within tolerance and it holds
    what the plan counts; FAIL naming the target when one process is off, holds other parameters, or is refused."""
    from bench.gpu import checks

    good = {"features": 1e-6, "topk_logprobs": 2e-6, "parameters": 10, "planned": 10}
    bad = {"pass": good, "off": {**good, "features": 3e-3}, "held": {**good, "parameters": 12},
           "refused": {"refused": "target.tensor_parallel=2 cannot shard x"}}[case]
    ranks = [{n: good for n in checks.SHARDED_TARGETS}, {**{n: good for n in checks.SHARDED_TARGETS},
                                                             "tiny_qwen3_moe": bad}]
    monkeypatch.setattr(checks.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="log line\n" + json.dumps(ranks) + "\n", stderr=""))
    monkeypatch.setattr(checks, "_cuda", lambda: torch.device("cuda"))
    monkeypatch.setattr(checks.torch.cuda, "device_count", lambda: 2)
    out = checks.sharded_extraction(60)
    assert out["status"] == ("PASS" if case == "pass" else "FAIL"), out["summary"]
    assert case == "pass" or "tiny_qwen3_moe" in out["summary"]


def test_the_gpu_check_keeps_its_compile_caches_in_the_checkout():
    """bench/gpu_check.sh points Triton's and TorchInductor's caches at build/compile-cache (ignored by git), so a
    later check on the machine reuses them; a cache directory exported before is kept."""
    script = (REPO / "bench/gpu_check.sh").read_text()
    exports = [ln for ln in script.splitlines() if ln.startswith("export ") and "_CACHE_DIR=" in ln]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TRITON_CACHE_DIR": "/mine"}
    shown = subprocess.run(["bash", "-c", "\n".join([*exports, 'echo "$TRITON_CACHE_DIR $TORCHINDUCTOR_CACHE_DIR"'])],
                           cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["/mine", str(REPO / "build/compile-cache/inductor")]
    ignored = subprocess.run(["git", "check-ignore", "-q", "build/compile-cache/triton"], cwd=REPO, check=False)
    assert ignored.returncode == 0
