"""dflash.evaluate.settings: what an evaluation's figures depend on, the tag that says where they differ from the
run's own, and the folder an evaluation writes (never over one at other settings)."""

import json

from dflash.evaluate.settings import evaluation_folder, figure_settings, job_config, reference_settings, settings_tag
from tests.conftest import compose


def settings(*overrides, in_run=False):
    return figure_settings(job_config(compose("evaluate", ["debug=tiny", *overrides])), in_run=in_run)


def own():
    """The run's own settings, as evaluate.py reads them from its config.yaml (a train job's groups, plain)."""
    return reference_settings(job_config(compose("train", ["debug=tiny"])))


def test_a_tag_names_each_setting_that_differs_from_the_runs_own():
    assert settings_tag(settings(), own()) == ""
    assert settings_tag(settings("eval.plots=true", "eval.compare=[/x]", "logger=wandb_offline"), own()) == ""
    assert settings_tag(settings("eval.max_prompts=6"), own()) == "6prompts"
    assert settings_tag(settings("eval.max_prompts=null"), own()) == "allprompts"
    # sampling keeps its word first, as sampled folders were named (step-000768-t1-k20)
    assert settings_tag(settings("eval.decode.temperature=1", "eval.decode.top_k=20", "eval.decode.seed=3",
                                 "eval.dtype=bfloat16"), own()) == "t1-k20-seed3-bfloat16"
    assert settings_tag(settings("eval=live", "eval.max_new_tokens=24", "eval.ddtree_budgets=[]"),
                        own()) == "24tokens-ddtree-none"  # the mode is the folder's -live, not a word
    suite = settings("eval.suite.name=zlab", "eval.suite.protocol=first_turn")
    assert settings_tag(suite, own()) == "suite-zlab-protocol-first_turn"
    assert settings_tag(settings("data=toy"), own()) == "prompts-toy_stdlib_eval-batch64"
    assert settings_tag(settings("target=tiny_gemma"), own()) == "target-tiny_gemma"
    # a key that only applies elsewhere is no setting here: top_k at temperature 0, a suite's protocol without one
    assert settings_tag(settings("eval.decode.top_k=20", "eval.suite.protocol=first_turn",
                                 "eval.decode.warmup_tokens=0"), own()) == ""
    # the in-run evaluation is teacher-forced on eval.prompts whatever eval.mode and eval.suite.name say
    assert settings(in_run=True) == settings("eval=live", "eval.suite.name=zlab", in_run=True) == settings()


def test_a_config_yaml_without_a_newer_key_reads_its_default():
    cfg = job_config(compose("train", ["debug=tiny"]))
    del cfg["eval"]["decode"]["selector_beam"], cfg["data"]["tools"]
    assert figure_settings(cfg, in_run=True) == settings()
    assert json.loads(json.dumps(settings())) == settings()  # as summary.json gives it back


def old_names(tree: dict) -> dict:
    """A config as dflash wrote it before eval.decode, eval.suite, eval.serving and loss.selector: flat keys."""
    ev, loss = dict(tree["eval"]), dict(tree.get("loss", {}))
    ev.update(ev.pop("decode"))
    suite = ev.pop("suite")
    ev.update(suite=suite.pop("name"), **suite)
    ev.update({f"serving_{k}": v for k, v in ev.pop("serving").items()})
    loss.update({f"selector_{k}": v for k, v in loss.pop("selector", {}).items()})
    return {**tree, "eval": ev, **({"loss": loss} if "loss" in tree else {})}


def test_a_config_yaml_and_a_summary_written_before_the_sub_groups_read_as_today(tmp_path):
    """A run trained before the keys moved (config.yaml with eval.temperature, eval.suite, loss.selector_shrink) has
    the same own settings, and an evaluation folder recorded with the old names is rewritten by the same evaluation,
    not left for a -2 beside it: nothing saved before is lost."""
    import yaml

    from dflash.layout import RunLayout
    from dflash.tracking import config_dict

    job = compose("evaluate", ["debug=tiny", "eval.decode.temperature=0.5", "eval.suite.name=zlab",
                               "loss.selector.shrink=0.4", "eval.serving.gpu=h100"])
    run = RunLayout(tmp_path / "run")
    run.path.mkdir()
    old = old_names(config_dict(job))
    assert old["eval"]["temperature"] == 0.5 and old["eval"]["suite"] == "zlab" and "decode" not in old["eval"]
    run.config.write_text(yaml.safe_dump(old))
    assert run.trained_config() == config_dict(job)
    assert reference_settings(run.trained_config()) == reference_settings(job_config(job))
    mine = figure_settings(job_config(job))
    flat = {k.replace("eval.decode.", "eval.").replace("eval.suite.name", "eval.suite").replace("eval.suite.", "eval.")
            .replace("eval.serving.", "eval.serving_"): v for k, v in mine.items()}
    assert "eval.temperature" in flat and "eval.suite" in flat
    write(tmp_path / "step-000120-t0.5-suite-zlab", flat)
    assert evaluation_folder(tmp_path, "step-000120", mine, reference_settings(job_config(compose(
        "train", ["debug=tiny"])))) == (tmp_path / "step-000120-t0.5-suite-zlab", "t0.5")


def write(folder, recorded):
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"metrics": {}, **({"settings": recorded} if recorded else {})}))


def test_the_folder_is_the_runs_own_at_its_settings_and_beside_it_at_others(tmp_path):
    mine, fewer = settings(), settings("eval.max_prompts=1")
    assert evaluation_folder(tmp_path, "step-000120", mine, own()) == (tmp_path / "step-000120", "")
    write(tmp_path / "step-000120", mine)
    assert evaluation_folder(tmp_path, "step-000120", mine, own()) == (tmp_path / "step-000120", "")  # rewritten
    assert evaluation_folder(tmp_path, "step-000120", fewer, own()) == (tmp_path / "step-000120-1prompts", "1prompts")
    assert evaluation_folder(tmp_path, "step-000120-live", settings("eval=live"), own()) == (
        tmp_path / "step-000120-live", "")


def test_a_folder_recording_other_settings_or_none_is_never_written_over(tmp_path):
    """Words that cannot tell two settings apart (a prompt file of the same name elsewhere), or a folder from before
    settings were recorded: the next free name; one recording the same settings is taken again."""
    a, b = settings("eval.prompts=/a/p.jsonl"), settings("eval.prompts=/b/p.jsonl")
    write(tmp_path / "step-000120-prompts-p", a)
    assert evaluation_folder(tmp_path, "step-000120", b, own()) == (tmp_path / "step-000120-prompts-p-2", "prompts-p")
    write(tmp_path / "step-000120-prompts-p-2", b)
    assert evaluation_folder(tmp_path, "step-000120", b, own())[0] == tmp_path / "step-000120-prompts-p-2"
    write(tmp_path / "step-000120", None)  # written before settings were: maybe other settings
    assert evaluation_folder(tmp_path, "step-000120", settings(), own()) == (tmp_path / "step-000120-2", "")
    (tmp_path / "step-000200").mkdir()  # an evaluation that did not finish: nothing to keep (moved aside as before)
    assert evaluation_folder(tmp_path, "step-000200", settings(), own())[0] == tmp_path / "step-000200"


def test_outside_a_run_the_first_greedy_evaluation_is_the_reference(tmp_path):
    """A drafter folder of no run: a sampled evaluation is tagged as before (zlab-t1), the first one under the plain
    name is what later ones at other settings are told apart from."""
    sampled = settings("eval.decode.temperature=1")
    assert evaluation_folder(tmp_path, "zlab", sampled, None) == (tmp_path / "zlab-t1", "t1")
    assert evaluation_folder(tmp_path, "zlab", settings(), None) == (tmp_path / "zlab", "")
    write(tmp_path / "zlab", settings("eval.max_prompts=6"))
    assert evaluation_folder(tmp_path, "zlab", settings("eval.max_prompts=6"), None)[0] == tmp_path / "zlab"
    assert evaluation_folder(tmp_path, "zlab", settings(), None) == (tmp_path / "zlab-2prompts", "2prompts")
    assert evaluation_folder(tmp_path, "zlab", settings("eval.max_prompts=6", "eval.decode.temperature=1"), None) == (
        tmp_path / "zlab-t1", "t1")


def test_a_suites_metrics_keep_their_names_but_for_sampling(tmp_path):
    """A suite lands in a folder of its own (the in-run evaluation has none) while its metrics, eval/<bench>/*, are
    off the run's curves already: only sampling namespaces them, as before."""
    suite = settings("eval.suite.name=zlab", "eval.max_new_tokens=2048")
    assert evaluation_folder(tmp_path, "step-000120", suite, own()) == (
        tmp_path / "step-000120-suite-zlab-2048tokens", "")
    sampled = settings("eval.suite.name=zlab", "eval.decode.temperature=1")
    assert evaluation_folder(tmp_path, "step-000120", sampled, own()) == (tmp_path / "step-000120-t1-suite-zlab", "t1")
