import itertools
import re
import subprocess
import sys

import pytest
import yaml

from dflash.config import DrafterConfig, LossConfig, NoiseConfig, SelectorLossConfig
from dflash.errors import ConfigError
from tests.conftest import REPO, compose

GROUP_OPTIONS = sorted(  # conf/references/ holds published figures (eval.suite.references), not a config group
    (p.parent.name, p.stem) for p in (REPO / "conf").glob("*/*.yaml") if p.parent.name != "references")
REQUIRED = {("layers", "explicit"): ["layers.ids=[1,2,3]"],
            ("data", "jsonl"): ["data.prompts=/tmp/prompts.jsonl"]}


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    for g in ("target", "drafter", "layers", "noise", "loss", "data", "optim", "logger", "eval", "experiment"):
        assert g in groups, f"conf/{g}/ is missing"


@pytest.mark.parametrize("entry", ["train", "evaluate", "extract"])
def test_entry_configs_compose(entry):
    job = compose(entry)
    assert job.target.name and job.drafter.block_size >= 2 and job.features.dir


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_composes_to_dataclasses(group, option):
    overrides = [f"{group}={option}"] + REQUIRED.get((group, option), [])
    if group == "experiment":
        overrides.append("data.prompts=/tmp/prompts.jsonl")
    job = compose("train", overrides)
    assert type(job).__name__ == "JobConfig"


def test_presets_hold_the_public_shapes():
    q8 = compose("train", ["experiment=qwen3_8b", "data.prompts=x.jsonl"])
    assert (q8.target.num_layers, q8.target.mask_token_id, q8.drafter.block_size, q8.drafter.num_layers) == (
        36, 151669, 16, 5)
    q36 = compose("train", ["experiment=qwen3_6_27b", "data.prompts=x.jsonl"])
    assert q36.target.num_layers == 64 and q36.target.mask_token_id == 248070
    assert q36.drafter.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert q36.drafter.sliding_window == 2048
    q35 = compose("train", ["experiment=qwen3_5_27b", "data.prompts=x.jsonl"])
    assert q35.drafter.resolved_layer_types() == ["full_attention"] * 5


def test_the_toy_data_brings_its_cpu_recipe_and_other_data_the_papers():
    toy = compose("train")
    assert (toy.drafter.num_layers, toy.drafter.head_dim, toy.data.limit) == (2, 128, None)
    assert (toy.train.batch_size, toy.train.num_anchors, toy.train.max_steps, toy.optim.lr) == (4, 32, 768, 2e-3)
    assert toy.eval.completions_batch_size == 64
    for own in (["data=jsonl", "data.prompts=x.jsonl"], ["experiment=qwen3_8b", "data.prompts=x.jsonl"]):
        job = compose("train", own)
        assert (job.drafter.num_layers, job.drafter.head_dim) == (5, None)
        assert (job.train.batch_size, job.train.num_anchors, job.train.max_steps, job.optim.lr) == (1, 512, None, 6e-4)
        # answers generated 32 prompts a batch, training's and held-out alike (eval.completions_batch_size=1: alone)
        assert job.eval.completions_batch_size == job.data.completions.batch_size == 32
    # what the command line gives still wins over the toy data's choices
    mine = compose("train", ["drafter=default", "optim.lr=1e-3", "train.num_anchors=64"])
    assert (mine.drafter.num_layers, mine.optim.lr, mine.train.num_anchors) == (5, 1e-3, 64)


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_held_out_prompts_go_with_the_data_unless_given(entry):
    assert compose(entry, []).eval.prompts == "toy:stdlib_eval"  # the toy default: in its target's domain
    assert compose(entry, ["eval=live"]).eval.prompts == "toy:stdlib_eval"
    assert compose(entry, ["experiment=qwen3_8b", "data.prompts=x.jsonl"]).eval.prompts == "builtin:eval_coding"
    assert compose(entry, ["eval.prompts=/data/heldout.jsonl"]).eval.prompts == "/data/heldout.jsonl"
    assert compose(entry, ["data=jsonl", "data.prompts=x.jsonl", "data.eval_prompts=y.jsonl"]).eval.prompts == "y.jsonl"


def test_debug_tiny_is_the_tiny_and_fast_setup():
    job = compose("train", ["debug=tiny"])
    assert (job.target.name, job.data.name, job.drafter.num_layers, job.logger.backend) == (
        "tiny_qwen3", "tiny", 2, "none")
    assert job.data.completions.max_new_tokens == job.eval.max_new_tokens == 32
    assert (job.eval.max_prompts, job.eval.ddtree_budgets, job.eval.plots) == (2, [4], False)
    assert (job.train.num_anchors, job.train.num_workers, job.train.log_every) == (16, 0, 1)


@pytest.mark.parametrize("overrides", [["debug=tiny", "target=tiny_qwen3_5"], ["target=tiny_qwen3_5", "debug=tiny"]])
def test_a_group_given_on_the_command_line_wins_over_debug(overrides):
    job = compose("train", overrides + ["logger=wandb_offline"])
    assert job.target.name == "tiny_qwen3_5" and job.logger.backend == "wandb"
    assert job.drafter.num_layers == 2 and job.train.num_anchors == 16


def sweep_runs():
    """(sweep file, overrides, expected values) for every run a W&B sweep in sweeps/ can start: the
    product of each parameter's values (a distribution's min and max), plus the command's fixed
    key=value arguments. W&B passes ${args_no_hyphens} as key=str(value)."""
    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        fixed = [a for a in spec["command"] if re.fullmatch(r"[\w.]+=[^$]+", str(a))]
        if any(a.startswith("experiment=") for a in fixed):
            fixed.append("data.prompts=/tmp/x.jsonl")  # the experiments read the user's prompts
        keys = list(spec["parameters"])
        choices = [p["values"] if "values" in p else [p["min"], p["max"]] for p in spec["parameters"].values()]
        for values in itertools.product(*choices):
            yield path.name, fixed + [f"{k}={v}" for k, v in zip(keys, values)], dict(zip(keys, values))


SWEEP_RUNS = list(sweep_runs())


@pytest.mark.parametrize("sweep,overrides,expected", SWEEP_RUNS,
                         ids=[f"{s}:{','.join(o)}" for s, o, _ in SWEEP_RUNS])
def test_every_wandb_sweep_run_composes_and_sets_its_parameters(sweep, overrides, expected):
    job = compose("train", overrides)
    for key, value in expected.items():
        section, field = key.split(".")
        want = yaml.safe_load(value) if isinstance(value, str) else value  # "[1,9,17]" arrives as a list
        assert getattr(getattr(job, section), field) == want, key
    if "logger=wandb" in overrides:
        assert job.logger.backend == "wandb" and job.logger.mode == "online"


def test_unknown_preset_names_the_available_ones():
    result = run_entry("train.py", "target=nope")
    assert result.returncode != 0
    assert "Could not find 'target/nope'" in result.stderr
    for preset in ("qwen3_8b", "qwen3_5_27b", "qwen3_6_27b", "tiny_qwen3", "tiny_qwen3_5"):
        assert preset in result.stderr


def test_unknown_key_is_refused():
    result = run_entry("train.py", "optim.lrr=1")
    assert result.returncode != 0 and "Key 'lrr' not in 'OptimConfig'" in result.stderr


def test_bad_value_exits_with_the_key_named():
    result = run_entry("train.py", "drafter.block_size=1")
    assert result.returncode == 2 and "drafter.block_size=1" in result.stderr + result.stdout


def test_explained_errors_print_one_message_without_a_traceback(tmp_path):
    result = run_entry("evaluate.py", "run.name=nope", f"run.root={tmp_path}", "logger=none")
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "no run 'nope'" in out and "Traceback" not in out


@pytest.mark.parametrize("entry", ["train.py", "evaluate.py", "extract.py"])
def test_cfg_job_prints_the_config(entry):
    result = run_entry(entry, "--cfg", "job")
    assert result.returncode == 0 and "target:" in result.stdout and "drafter:" in result.stdout


def test_entry_points_write_no_log_file_in_the_working_directory(tmp_path):
    """Hydra's default job logging would append a <job>.log to the cwd on every call."""
    result = run_entry("train.py", "drafter.block_size=1", cwd=tmp_path)
    assert result.returncode == 2 and list(tmp_path.iterdir()) == []


def run_entry(script, *args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("make,needle", [
    (lambda: DrafterConfig(block_size=1), "drafter.block_size"),
    (lambda: DrafterConfig(num_layers=2, layer_types=["full_attention"]), "drafter.layer_types"),
    (lambda: DrafterConfig(num_layers=1, layer_types=["sliding_attention"]), "drafter.sliding_window"),
    (lambda: NoiseConfig(kind="gaussian", scale=0.0), "noise.scale"),
    (lambda: NoiseConfig(kind="pink"), "noise.kind"),
    (lambda: LossConfig(objective="tv", temperature=0.0), "loss.temperature=0.0 must be > 0"),
    (lambda: LossConfig(objective="kl", temperature=2.0), "loss.temperature=2.0 applies to"),
    (lambda: LossConfig(objective="expected_tau", normalize="weights"), "loss.normalize=weights"),
    (lambda: LossConfig(objective="expected_tau", kl_weights="dpace"), "loss.kl_weights=dpace"),
    (lambda: SelectorLossConfig(gradient="both"), "loss.selector.gradient='both' is not valid; expected one of "
                                                  "['coupled', 'detach_unary', 'stop']"),
    (lambda: SelectorLossConfig(gold="skip"), "loss.selector.gold='skip' is not valid; expected one of "
                                              "['inject', 'strict']"),
    (lambda: SelectorLossConfig(init="xavier"), "loss.selector.init='xavier'"),
    (lambda: SelectorLossConfig(weights="dpace"), "loss.selector.weights='dpace'"),
    (lambda: SelectorLossConfig(labels="teacher"), "loss.selector.labels='teacher'"),
    (lambda: SelectorLossConfig(decay=-0.1), "loss.selector.decay=-0.1 must be >= 0"),
    (lambda: SelectorLossConfig(shrink=-0.5), "loss.selector.shrink=-0.5 must be >= 0"),
    (lambda: SelectorLossConfig(dropout=1.0), "loss.selector.dropout=1.0 must be in [0, 1)"),
    (lambda: SelectorLossConfig(warmup_ratio=1.5), "loss.selector.warmup_ratio=1.5 must be in [0, 1]"),
    (lambda: SelectorLossConfig(warmup_ratio=0.6, ramp_ratio=0.5), "loss.selector.warmup_ratio + "
                                                                   "loss.selector.ramp_ratio = 1.1"),
])
def test_cross_field_checks(make, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make()


def test_the_selector_defaults_are_todays_training():
    """The loss.selector.* keys' defaults: coupled gradients (issue 50's sweep made them the default), gold
    injected, no schedule, normal init, decay weights, data labels, the codebooks decayed as any matrix, no
    dropout, the pairwise term served at 0.6 of the trained one (the same sweep), free codebook rows."""
    assert vars(compose("train", ["drafter=dflash2"]).loss.selector) == {
        "weight": 1.0, "gradient": "coupled", "gold": "inject", "warmup_ratio": 0.0, "ramp_ratio": 0.0,
        "init": "normal", "weights": "decay", "labels": "data", "decay": None, "dropout": 0.0, "shrink": 0.6,
        "span": "free"}


def test_dflash2_takes_32_candidates_and_its_published_presets_16():
    """drafter.kind=dflash2 on any preset takes 32 candidates (issue 50's sweep on the toy); the presets of the
    published drafters (drafter=dflash2, drafter=qwen3_6_27b_dflash2) keep their 16."""
    assert compose("train", ["drafter.kind=dflash2"]).drafter.selector_top_k == 32
    assert compose("train", ["experiment=qwen3_8b", "data.prompts=x.jsonl",
                             "drafter.kind=dflash2"]).drafter.selector_top_k == 32
    for preset in ("dflash2", "qwen3_6_27b_dflash2"):
        assert compose("train", [f"drafter={preset}"]).drafter.selector_top_k == 16


def test_gamma_defaults_by_block_size():
    assert [LossConfig().gamma_for(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert LossConfig(gamma=3.0).gamma_for(12) == 3.0
    with pytest.raises(ConfigError, match="loss.gamma"):
        LossConfig().gamma_for(12)


@pytest.mark.parametrize("option,weighting,normalizer", [
    ("tv", "decay", "weights"), ("nla", "decay", "weights"), ("expected_tau", "decay", "anchor")])
def test_the_acceptance_losses_compose_with_their_weights_and_normaliser(option, weighting, normalizer):
    loss = compose("train", [f"loss={option}", "loss.temperature=0.5", "train.mode=online"]).loss
    assert (loss.objective, loss.temperature, loss.weighting, loss.normalizer) == (option, 0.5, weighting, normalizer)
    assert loss.soft_labels
    if option != "expected_tau":  # D-PACE weights as loss=kl takes them
        loss = compose("train", [f"loss={option}", "loss.kl_weights=dpace"]).loss
        assert (loss.weighting, loss.normalizer) == ("dpace", "anchor")


def test_config_error_surfaces_through_compose():
    with pytest.raises(Exception) as e:
        compose("train", ["drafter.block_size=1"])
    text = f"{e.value} {e.value.__cause__}"
    assert "drafter.block_size=1" in text


def test_tool_data_keys_default_to_ending_at_a_differing_call_and_stopping_at_a_bad_record():
    """data.tools.keep_results (false: a conversation ends at a call other than the recorded one) and
    data.skip_bad_records (false: a bad record stops preparation); keep_results needs a regeneration that makes calls
    followed by results (all_turns, in data.regenerate or a source's)."""
    job = compose("train", ["debug=tiny"])
    assert job.data.tools.keep_results is False and job.data.skip_bad_records is False
    assert compose("train", ["debug=tiny", "data.tools.keep_results=true", "data.skip_bad_records=true"]).data.tools
    with pytest.raises(Exception) as e:
        compose("train", ["debug=tiny", "data.tools.keep_results=true", "data.regenerate=last_turn"])
    assert "data.tools.keep_results=true" in f"{e.value} {e.value.__cause__}"
    mixed = ("data.sources=[{prompts: builtin:tiny_prompts, regenerate: first_turn}, "
             "{prompts: builtin:tiny_prompts, regenerate: all_turns}]")
    assert compose("train", ["debug=tiny", "data.tools.keep_results=true", "data.regenerate=last_turn", mixed])


def test_features_are_stored_in_the_targets_dtype_unless_asked_otherwise():
    """features.storage=auto is resolved where a cache is made (dflash.data.extraction.cache_storage), never
    written back: the composed config keeps auto."""
    from dflash.config.data import rounds, storage_for

    assert compose("train").features.storage == "auto"
    assert compose("train", ["features.storage=float16"]).features.storage == "float16"
    assert [storage_for("auto", d) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float16"]
    assert storage_for("float8_e4m3fn", "float32") == "float8_e4m3fn"
    # exact: the target's own dtype, or float32 (which holds bfloat16 and float16); anything else rounds
    assert not any(rounds(s, d) for s, d in [("float32", "float32"), ("bfloat16", "bfloat16"),
                                             ("float32", "bfloat16"), ("float16", "float16")])
    assert all(rounds(s, d) for s, d in [("bfloat16", "float32"), ("float8_e4m3fn", "float32"),
                                         ("float8_e4m3fn", "bfloat16"), ("float16", "bfloat16")])


def test_moved_keys_migrate_new_names_first_and_the_suite_group_is_not_refused():
    """dflash.config.renamed: an old config (eval.suite null, a flat selector key) reads under today's names; where a
    file holds both names the new one's value wins, in a config.yaml and in summary.json's settings alike; the
    group eval.suite given whole ({name: ..., protocol: ...}) is today's syntax, not the old key."""
    from dflash.config import migrate_settings, migrate_tree, refuse_renamed

    old = {"eval": {"suite": None, "temperature": 0.5, "decode": {"temperature": 0.7}}, "loss": {"selector_shrink": 1}}
    assert migrate_tree(old) == {"eval": {"suite": {"name": None}, "decode": {"temperature": 0.7}},
                                 "loss": {"selector": {"shrink": 1}}}
    assert old["eval"]["temperature"] == 0.5  # the tree given is left as it was
    assert migrate_settings({"eval.decode.seed": 2, "eval.seed": 1, "eval.mode": "live"}) == {
        "eval.decode.seed": 2, "eval.mode": "live"}
    assert migrate_settings({"eval.seed": 1}) == {"eval.decode.seed": 1} and migrate_settings(None) is None
    refuse_renamed(["eval.suite={name:paper,protocol:zlab_bb48ef9}", "eval.suite.name=zlab", "eval.mode=live"])
    with pytest.raises(ConfigError, match=r"eval.top_k is now eval.decode.top_k: write ~eval.decode.top_k$"):
        refuse_renamed(["~eval.top_k"])
    with pytest.raises(ConfigError, match=r"write loss.selector.shrink=0.4,0.6$"):
        refuse_renamed(["loss.selector_shrink=0.4,0.6"])
