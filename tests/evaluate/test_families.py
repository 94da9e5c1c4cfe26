"""Every supported target family end to end on its tiny built-in target: extraction (with the family's kernels in
the manifest), training, teacher-forced evaluation and live decoding, chain and DDTree, lossless against plain
greedy decoding in float32, and the teacher-forced decoding walk equal to live decoding on the same completions."""

import json

import pytest
import torch

from dflash.errors import ConfigError
from dflash.evaluate.runner import evaluate
from dflash.io import read_json
from dflash.layout import RunLayout
from dflash.target import load_target
from dflash.train.loop import train
from tests.conftest import compose

FAMILIES = {  # target: (what its manifest's kernel report must hold, its embedding scale and softcap)
    "tiny_llama": ({"full_attention": "sdpa"}, (1.0, None)),
    "tiny_gemma": ({"full_attention": "sdpa", "sliding_attention": "sdpa"}, (8.0, 1.0)),
    "tiny_gpt_oss": ({"full_attention": "eager", "sliding_attention": "eager", "attention_sinks": "learned",
                      "moe": "top2of4,experts=grouped_mm"}, (1.0, None)),
    "tiny_qwen3_moe": ({"full_attention": "sdpa", "moe": "top2of4,norm_topk=true,experts=grouped_mm"}, (1.0, None)),
    "tiny_qwen3_5_moe": ({"full_attention": "sdpa", "linear_attention": "torch_fallback",
                          "causal_conv1d": "torch_fallback", "moe": "top2of4,experts=grouped_mm"}, (1.0, None)),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_train_then_live_evaluation_is_lossless_and_equals_the_walk(workdir, name):
    kernels, (scale, cap) = FAMILIES[name]
    common = ["debug=tiny", f"target={name}", f"run.root={workdir}/runs", f"run.name={name}", "eval.max_prompts=2",
              "eval.ddtree_budgets=[4,16]", f"features.dir={workdir}/{name}/features"]
    # a few steps: on these random-weight targets longer training only memorises the training prompts
    run = train(compose("train", [*common, "train.max_steps=4"]))
    manifest = read_json(workdir / name / "features" / "manifest.json")
    assert {k: manifest["kernels"][k] for k in kernels} == kernels and set(manifest["kernels"]) == set(kernels)
    final = RunLayout(run).list_checkpoints()[-1][1]
    dflash_config = json.loads((final / "config.json").read_text())["dflash_config"]
    # the export carries the target's scales where servers read them, and only where they are not the identity
    assert dflash_config.get("input_embedding_scale", 1.0) == scale
    assert dflash_config.get("final_logit_softcapping") == cap
    assert "output_multiplier" not in dflash_config

    forced = evaluate(compose("evaluate", [*common, "checkpoint=latest"]))
    live = evaluate(compose("evaluate", [*common, "checkpoint=latest", "eval=live"]))
    assert live["eval/live_ties"] == 0  # live_eval raises on any other divergence from plain greedy decoding
    # the same greedy completions decoded live and walked teacher-forced: the same blocks, the same tau
    assert live["eval/live_tau"] == pytest.approx(forced["eval/tau"])
    assert live["eval/live_ddtree@16_tau"] == pytest.approx(forced["eval/ddtree@16"])
    assert forced["eval/ddtree@16"] > 1.0  # drafts are accepted, so the trees' accepted paths are committed too


@pytest.mark.parametrize("name", ["tiny_gemma", "tiny_gpt_oss"])
def test_held_out_sequences_run_past_the_sliding_window(name):
    """The windows are exercised: every held-out prompt is longer than the tiny targets' window of 8, so that
    trees verified in one sequence must keep each sliding layer's window to stay lossless (above)."""
    job = compose("evaluate", ["debug=tiny", f"target={name}", "eval.max_prompts=2"])
    target = load_target(job.target, torch.device("cpu"))
    from dflash.data.prompts import encode, load_prompts, prompt_text

    window = target.config.sliding_window
    prompts = load_prompts(job.eval.prompts, limit=job.eval.max_prompts)
    lengths = [len(encode(target.tokenizer, prompt_text(target.tokenizer, p, True, job.data.enable_thinking)))
               for p in prompts]
    assert window == 8 and min(lengths) > 4 * window
    assert target.tree_verification() == "sequence"


def test_evaluate_takes_the_target_the_run_was_trained_with(workdir):
    """`python train.py target=tiny_llama`, then `python evaluate.py eval=live checkpoint=latest` with no target on
    its command line: the checkpoint's run names its target, so it is evaluated on tiny_llama (the default target,
    another hidden size, would be refused). A command line naming a target keeps it."""
    from dflash.cli import names_target

    name = "tiny_llama"
    run_dir = workdir / "runs" / name
    if not run_dir.exists():
        pytest.skip("needs the tiny_llama run trained above")
    job = compose("evaluate", [f"run.root={workdir}/runs", f"run.name={name}", "checkpoint=latest", "eval=live",
                               "eval.max_prompts=1", "eval.max_new_tokens=16", "eval.ddtree_budgets=[4]"])
    assert job.target.name == "toy"
    with pytest.raises(ConfigError, match="hidden size 64 but the target has 128"):
        evaluate(job)  # the composed default target, as before
    metrics = evaluate(job, target_from_run=True)
    assert metrics["eval/live_ties"] == 0 and metrics["eval/live_tokens"] == 16
    assert not names_target(["eval=live", "checkpoint=latest", "run.name=x"])
    assert all(names_target([o]) for o in ("target=qwen3_8b", "target.path=/m", "experiment=qwen3_8b", "debug=tiny",
                                           "+target.revision=main"))


def test_the_kernel_report_names_gemma_4_s_experts_too():
    """Gemma 4's MoE (26B-A4B) spells its experts per token top_k_experts."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from dflash.target.identity import kernel_report

    config = Gemma4TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                              hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                              moe_intermediate_size=8, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert kernel_report(model, config.layer_types)["moe"].startswith("top2of4,experts=")
