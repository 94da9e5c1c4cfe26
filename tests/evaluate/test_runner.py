"""Held-out evaluation: metric truth, outputs, references side by side, provenance, W&B."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash.config import DrafterConfig, LayersConfig
from dflash.dist import Dist
from dflash.drafter.build import build_drafter
from dflash.errors import CacheError, CheckpointError, ConfigError, ProvenanceError
from dflash.evaluate import heldout
from dflash.evaluate.runner import evaluate
from dflash.evaluate.teacher_forced import summarize, teacher_forced
from dflash.train.loop import train
from tests.conftest import compose, tiny_job
from tests.oracle import OracleDrafter


class FakeRun:
    def __init__(self, store, id):
        self.id, self.store = id, store
        self.summary = {}
        store["runs"].append(self)
        self.logged, self.metrics, self.summaries, self.artifacts = [], [], {}, []

    def define_metric(self, name, step_metric=None, summary=None):
        self.metrics.append((name, step_metric))
        if summary:
            self.summaries[name] = summary

    def log_artifact(self, artifact, aliases=None):
        self.artifacts.append((artifact, list(aliases or [])))

    def log(self, data):
        self.logged.append(data)

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    store = {"init": [], "runs": []}

    def init(**kw):
        store["init"].append(kw)
        return FakeRun(store, kw.get("id") or f"run{len(store['init'])}")

    monkeypatch.setattr(wandb, "init", init)
    return store


def eval_job(tmp, *overrides, target="tiny_qwen3"):
    return tiny_job("evaluate", tmp, "eval.max_new_tokens=40", "eval.ddtree_budgets=[2,8]", "eval.plots=true",
                    *overrides, target=target)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dflash_home):
    tmp = tmp_path_factory.mktemp("evalrun")
    job = eval_job(tmp, "run.name=r1", "train.max_steps=4", "train.save_every=2")
    run = train(job)
    return tmp, run


def test_oracle_drafter_gets_tau_B_and_random_drafter_about_1(trained, tiny_targets):
    tmp, _ = trained
    target = tiny_targets["tiny_qwen3"]
    job = eval_job(tmp, "eval.max_prompts=1")
    heldout.prepare(job, target, [1, 3], Dist())
    eval_set = heldout.load(job, target, [1, 3])
    ids, _, _ = eval_set[0]
    oracle = OracleDrafter(target, ids.tolist(), layer_ids=(1, 3), scale=5000.0)  # sharp: ddtree@8 holds the path
    assert oracle.check_head()
    records = teacher_forced(oracle, target.embed_tokens, target.lm_head, eval_set, job.eval)
    assert records and all(r["streak"] == len(r["target_tokens"]) == 7 for r in records if r["all_anchors"])
    m = summarize(records, 8, [2, 8])["metrics"]
    assert m["eval/tau_all_anchors"] == 8.0 and m["eval/acc@7"] == 1.0 and m["eval/ddtree@8_all_anchors"] == 8.0
    assert m["eval/full_all_anchors"] == 1.0
    # the walk: whole blocks of 8, then what is left of the 40 tokens after the prefill's first (39 = 4 x 8 + 7)
    assert m["eval/blocks"] == 5 and m["eval/tau"] == 39 / 5 and m["eval/ddtree@8"] == 39 / 5
    assert m["eval/full"] == 4 / 5
    torch.manual_seed(0)
    rand = build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(ids=[1, 3]), target)
    m = summarize(teacher_forced(rand, target.embed_tokens, target.lm_head, eval_set, job.eval), 8, [2, 8])["metrics"]
    assert 1.0 <= m["eval/tau"] < 1.15 and 1.0 <= m["eval/ddtree@2"] <= m["eval/ddtree@8"]
    assert 1.0 <= m["eval/tau_all_anchors"] < 1.15 and m["eval/full"] == m["eval/full_all_anchors"] == 0.0


def test_full_is_the_share_of_blocks_with_every_drafted_token_accepted():
    target = [5, 6, 7, 8]  # B = 5: four drafted slots

    def block(draft):
        return {"prompt_id": "p", "anchor": 0, "target_tokens": target, "draft_tokens": draft,
                "topk_ids": [[t] for t in draft], "topk_logprobs": [[0.0]] * 4, "streak": 0}
    records = [block([5, 6, 7, 8]), block([5, 6, 7, 0]), block([0, 6, 7, 8]), block([5, 6, 7, 8])]
    s = summarize(records, 5, [4])  # records without walk fields: blocks of the every-anchor mean only
    assert s["metrics"]["eval/full_all_anchors"] == 0.5
    assert s["metrics"]["eval/tau_all_anchors"] == (5 + 4 + 1 + 5) / 4


def test_outputs_agree_with_blocks_jsonl_and_ddtree_is_monotone(trained, capsys):
    tmp, run = trained
    metrics = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4"))
    out = run / "eval" / "step-000004"
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "blocks.jsonl").read_text().splitlines()]
    from_records = {k: summary[k] for k in ("metrics", "tau_histogram", "per_prompt", "block_size", "ddtree_budgets")}
    gap = ("eval/train_", "eval/gap_")  # from the run's train metrics, not from the records
    from_records["metrics"] = {k: v for k, v in summary["metrics"].items() if not k.startswith(gap)}
    assert summarize(records, 8, [2, 8]) == from_records
    assert metrics == summary["metrics"] and summary["metrics"]["eval/prompts"] == 2
    assert set(records[0]) >= {"prompt_id", "anchor", "target_tokens", "draft_tokens", "topk_ids", "streak"}
    assert 1.0 <= metrics["eval/ddtree@2"] <= metrics["eval/ddtree@8"]  # nested trees: never falls with N
    assert (out / "acc_per_position.png").exists() and (out / "tau_histogram.png").exists()
    # the train/eval gap: the train window nearest step 4 against the same (every-anchor) estimator held out
    window = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/tau" in r][-1]
    assert window["step"] == metrics["eval/train_step"] == 4 and metrics["eval/train_tau"] == window["train/tau"]
    assert metrics["eval/gap_tau"] == pytest.approx(metrics["eval/tau_all_anchors"] / window["train/tau"])
    printed = capsys.readouterr().out
    assert "step4" in printed and f"held-out every-anchor tau {metrics['eval/tau_all_anchors']:.3f}" in printed


def test_the_in_run_evaluation_scores_the_drafter_its_checkpoint_serves(tmp_path, dflash_home):
    """On a float32 target the in-run evaluation scored the float32 weights, evaluate.py the served bf16 ones
    (train.save_dtype): two figures for one checkpoint (2.003 against 2.005 for a DFlash 2 toy run). Both now
    score the served weights: the same blocks, the same top-k log-probabilities to the bit."""
    run = train(eval_job(tmp_path, "run.name=served", "train.max_steps=2", "drafter.kind=dflash2",
                         "drafter.selector_rank=32"))
    in_run = (run / "eval" / "step-000002" / "blocks.jsonl").read_text()
    evaluate(eval_job(tmp_path, "run.name=served", "checkpoint=step2", "drafter.kind=dflash2",
                      "drafter.selector_rank=32"))
    post_hoc = (run / "eval" / "step-000002" / "blocks.jsonl").read_text()
    assert list(run.glob("eval/step-000002.*")), "the in-run evaluation was moved aside, not overwritten"
    assert [json.loads(line) for line in in_run.splitlines()] == [json.loads(line) for line in post_hoc.splitlines()]


def test_an_evaluation_at_other_settings_lands_beside_the_runs_own(trained, caplog):
    """evaluate.py with fewer prompts replaced the in-run evaluation of that step (summary.json, blocks.jsonl) with its
    figures, and the run's curve read them. Now the run's own stays byte for byte, the other lands beside it in a
    folder whose name says what differs, its metrics under a namespace of their own; the report's curve still reads
    the in-run figures. The same command again rewrites its own folder (the same settings, recorded in it)."""
    import logging

    from dflash.layout import RunLayout
    from dflash.report.compare import load_run

    tmp, run = trained
    copy = tmp / "runs" / "r1other"  # the module's run stays as the other tests expect it
    shutil.copytree(run, copy)
    own = copy / "eval" / "step-000004"
    before = {f: (own / f).read_bytes() for f in ("summary.json", "blocks.jsonl")}
    kept = set(copy.glob("eval/step-000004.*"))  # evaluations at the run's settings before this test's, kept aside
    in_run = json.loads(before["summary.json"])
    assert in_run["settings"]["eval.max_prompts"] == 2 and in_run["metrics"]["eval/prompts"] == 2
    with caplog.at_level(logging.INFO, logger="dflash.evaluate.settings"):
        metrics = evaluate(eval_job(tmp, "run.name=r1other", "checkpoint=latest", "eval.max_prompts=1"))
    assert {f: (own / f).read_bytes() for f in before} == before
    assert set(copy.glob("eval/step-000004.*")) == kept  # not moved aside either: left where it was
    other = copy / "eval" / "step-000004-1prompts"
    summary = json.loads((other / "summary.json").read_text())
    assert summary["settings"] == {**in_run["settings"], "eval.max_prompts": 1} and metrics["eval/prompts"] == 1
    assert "eval.max_prompts: 2 there, 1 here" in caplog.text and "eval/1prompts/*" in caplog.text
    # the run's curve: its own folder, and eval/tau in metrics.jsonl only from the in-run evaluations
    assert [p.parent.name for _, p in RunLayout(copy).step_evaluations()][-1] == "step-000004"
    assert load_run(copy)["evals"][4] == in_run
    logged = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/1prompts/tau"] for r in logged if "eval/1prompts/tau" in r] == [metrics["eval/tau"]]
    assert [r["step"] for r in logged if "eval/tau" in r] == [r["step"] for r in map(json.loads, (
        run / "metrics.jsonl").read_text().splitlines()) if "eval/tau" in r]
    # the same settings again: the same folder (its figures again, the earlier copy kept under a dated name)
    evaluate(eval_job(tmp, "run.name=r1other", "checkpoint=latest", "eval.max_prompts=1"))
    assert json.loads((other / "summary.json").read_text())["metrics"] == summary["metrics"]
    assert len(list(copy.glob("eval/step-000004-1prompts*"))) == 2
    # the run's own settings: its own folder, the same figures
    assert evaluate(eval_job(tmp, "run.name=r1other", "checkpoint=latest"))["eval/tau"] == in_run["metrics"]["eval/tau"]
    assert json.loads((own / "summary.json").read_text())["settings"] == in_run["settings"]


def test_reference_drafter_evaluates_next_to_the_checkpoint(trained, capsys):
    tmp, run = trained
    ref = tmp / "reference"
    shutil.copytree(run / "checkpoints" / "step-000002", ref, ignore=shutil.ignore_patterns("train_state"))
    evaluate(eval_job(tmp, "run.name=r1", "checkpoint=latest", f"eval.compare=[{ref}]"))
    table = capsys.readouterr().out
    assert "step4" in table and "reference" in table
    main = run / "eval" / "step-000004"
    assert (main / "compare" / "reference" / "summary.json").exists()
    a = [json.loads(x)["anchor"] for x in (main / "blocks.jsonl").read_text().splitlines()]
    b = [json.loads(x)["anchor"] for x in (main / "compare/reference/blocks.jsonl").read_text().splitlines()]
    assert a == b  # exactly the same blocks
    assert list(run.glob("eval/step-000004.*")), "the earlier evaluation was kept, not overwritten"


def test_compared_drafters_in_folders_of_one_name_each_keep_their_row_and_results(trained, capsys):
    tmp, run = trained
    a, b = tmp / "run_a" / "export", tmp / "run_b" / "export"
    for step, folder in ((2, a), (4, b)):
        shutil.copytree(run / "checkpoints" / f"step-00000{step}", folder, ignore=shutil.ignore_patterns("train_state"))
    evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", f"eval.compare=[{a},{b}]"))
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:5]]
    assert rows == ["step4", "run_a/export", "run_b/export"]
    main = run / "eval" / "step-000004"
    for label, folder in (("run_a/export", a), ("run_b/export", b)):
        summary = json.loads((main / "compare" / label.replace("/", "__") / "summary.json").read_text())
        assert (summary["label"], summary["drafter"]) == (label, str(folder))

    def drafts(out):
        return [json.loads(x)["draft_tokens"] for x in (out / "blocks.jsonl").read_text().splitlines()]
    assert drafts(main / "compare" / "run_b__export") == drafts(main)  # step 4's weights: step 4's drafts
    before = sorted(p.name for p in (run / "eval").iterdir())
    with pytest.raises(ConfigError, match=r"^eval.compare: '.*run_a/export' and '.*run_a/export' are the same "
                                          r"folder; name the compared drafters apart as name=path"):
        evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", f"eval.compare=[{a},{a}]"))
    assert sorted(p.name for p in (run / "eval").iterdir()) == before  # refused before anything was evaluated


def test_foreign_drafter_directory_evaluates_without_a_run(trained):
    tmp, run = trained
    ref = tmp / "zlab_style"
    shutil.copytree(run / "checkpoints" / "step-000004", ref, ignore=shutil.ignore_patterns("train_state"))
    metrics = evaluate(eval_job(tmp, f"checkpoint={ref}"))
    assert metrics["eval/blocks"] > 0 and (tmp / "runs" / "eval" / "zlab_style" / "summary.json").exists()


def test_unknown_checkpoint_lists_the_available_ones(trained):
    tmp, _ = trained
    with pytest.raises(CheckpointError, match=r"no checkpoint 'step7'.*available: step2, step4"):
        evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step7"))
    with pytest.raises(FileNotFoundError, match="no run 'nope'.*r1"):
        evaluate(eval_job(tmp, "run.name=nope"))


def test_features_from_another_backend_are_refused_unless_allowed(trained):
    tmp, run = trained
    bad = tmp / "runs" / "r1b"
    shutil.copytree(run, bad)
    manifest_path = bad / "checkpoints/step-000004/train_state/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["kernel_backend"] = "full_attention=flash_attention_2"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ProvenanceError, match=r"(?s)kernel_backend: .*flash_attention_2.*full_attention=sdpa.*"
                                              r"provenance.allow_mismatch=\[kernel_backend\]"):
        evaluate(eval_job(tmp, "run.name=r1b", "checkpoint=step4"))
    with pytest.raises(ProvenanceError, match="the live target's features"):  # live decoding is guarded too
        evaluate(eval_job(tmp, "run.name=r1b", "checkpoint=step4", "eval=live", "eval.max_new_tokens=8"))
    evaluate(eval_job(tmp, "run.name=r1b", "checkpoint=step4", "provenance.allow_mismatch=[kernel_backend]"))
    summary = json.loads((bad / "eval/step-000004/summary.json").read_text())
    assert summary["provenance_allowed"] == {"step4": ["kernel_backend"]}


def test_drafter_that_does_not_fit_the_target_is_refused(trained):
    tmp, run = trained
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match="reads target layers"):
        evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "target=tiny_qwen3", "target.num_layers=null",
                          "eval.compare=[" + str(_drafter_for_36_layers(tmp)) + "]"))


def _drafter_for_36_layers(tmp) -> Path:
    from transformers import Qwen3Config

    from dflash.drafter.build import drafter_config
    from dflash.drafter.model import DFlashDraftModel

    cfg = Qwen3Config(vocab_size=262, hidden_size=64, intermediate_size=64, num_hidden_layers=36,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = tmp / "deep_drafter"
    DFlashDraftModel(drafter_config(cfg, num_layers=1, block_size=8, target_layer_ids=[1, 33],
                                 mask_token_id=261)).save_pretrained(path)
    return path


def test_eval_lands_in_the_training_run_at_its_step(tmp_path, fake_wandb):
    run = train(eval_job(tmp_path, "run.name=w", "logger=wandb_offline", "train.max_steps=4", "train.save_every=2"))
    info = json.loads((run / "run.json").read_text())
    train_run = fake_wandb["runs"][0]
    assert info["wandb_id"] == train_run.id and ("eval/*", "train/step") in train_run.metrics
    assert train_run.summaries == {}  # the best tau is set from best.json, not W&B's per-process "max"
    taus = {d["train/step"]: d["eval/tau"] for d in train_run.logged if "eval/tau" in d}
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == {"step": 4, "tau": taus[4]}
    best_summary = {k: train_run.summary[k] for k in ("eval/tau", "eval/best_step")}
    assert best_summary == ({"eval/tau": taus[4], "eval/best_step": 4} if taus[4] >= taus[0] else
                            {"eval/tau": taus[0], "eval/best_step": 0})
    # each checkpoint as a model artifact referencing its folder (no upload): latest, step-N, best
    [(art2, aliases2), (art4, aliases4)] = train_run.artifacts
    assert art2.type == "model" and aliases2[:2] == ["latest", "step-2"] and aliases4[:2] == ["latest", "step-4"]
    folder = (run / "checkpoints/step-000004").resolve()
    refs = sorted(e.ref for e in art4.manifest.entries.values())
    assert "best" in aliases4 and refs == sorted(p.resolve().as_uri() for p in folder.rglob("*") if p.is_file())
    (run / "checkpoints" / "best.json").write_text(json.dumps({"step": 4, "tau": 5.0}))  # a better checkpoint on record
    evaluate(eval_job(tmp_path, "run.name=w", "logger=wandb_offline", "checkpoint=step2"))
    init = fake_wandb["init"][-1]
    assert init["id"] == info["wandb_id"] and init["resume"] == "allow" and init["job_type"] == "eval"
    eval_run = fake_wandb["runs"][-1]
    assert ("eval/*", "train/step") in eval_run.metrics
    scalars = [d for d in eval_run.logged if "eval/tau" in d]
    assert len(scalars) == 1 and scalars[0]["train/step"] == 2 and scalars[0]["eval/tau"] < 5.0
    assert eval_run.summary == {"eval/tau": 5.0, "eval/best_step": 4}  # the worse checkpoint, evaluated last
    assert any("eval/acc_per_position" in d for d in eval_run.logged)
    assert json.loads((run / "run.json").read_text())["wandb_id"] == info["wandb_id"]


def test_live_mode_is_lossless_and_reports_real_tau(trained, capsys):
    tmp, run = trained
    metrics = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval=live", "eval.max_new_tokens=24",
                                "eval.ddtree_budgets=[4]"))
    assert metrics["eval/live_tokens"] == 48 and 1.0 <= metrics["eval/live_tau"] <= 8
    assert metrics["eval/live_ddtree@4_tau"] >= 1.0 and metrics["eval/live_ties"] == 0
    assert (run / "eval/step-000004-live-24tokens-ddtree-4/summary.json").exists()  # the run's: 40 tokens, [2, 8]
    assert "tok/forward" in capsys.readouterr().out


def test_heldout_set_is_keyed_by_everything_that_changes_its_sequences(tmp_path, tiny_targets):
    import copy

    from dflash.evaluate.heldout import heldout_paths

    target = tiny_targets["tiny_qwen3"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')

    def path(*overrides, tgt=target):
        return heldout_paths(eval_job(tmp_path, f"eval.prompts={prompts}", *overrides), tgt, [1, 3])[0]

    base = path()
    for change in ("data.chat_template=false", "data.enable_thinking=true", "eval.max_prompts=1",
                   "eval.max_new_tokens=20", "eval.prompts=builtin:tiny_prompts", "eval.completions_batch_size=8",
                   "eval.completions_batch_size=1"):
        assert path(change) != base, change
    other_tokenizer = copy.deepcopy(target.tokenizer)
    other_tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert path(tgt=replace(target, tokenizer=other_tokenizer)) != base
    for same in ("data.max_length=100", "eval.every=5", "train.num_anchors=4"):  # not part of the held-out set
        assert path(same) == base, same
    # a set made one prompt at a time (the default before 32) keeps the key it had before the key held the batch size
    alone = eval_job(tmp_path, f"eval.prompts={prompts}", "eval.completions_batch_size=1")
    assert "completions_batch_size" not in heldout.heldout_key(alone.data, alone.eval, target)
    prompts.write_text('{"id": "a", "prompt": "one, edited"}\n{"id": "b", "prompt": "two"}\n')
    assert path() != base  # the same file name with other prompts


def test_heldout_set_in_an_explicit_folder_is_checked_against_the_settings(tmp_path, tiny_targets):
    from dflash.errors import CacheError

    target = tiny_targets["tiny_qwen3"]
    job = eval_job(tmp_path, f"eval.features_dir={tmp_path}/heldout", "eval.max_prompts=1")
    heldout.prepare(job, target, [1, 3], Dist())
    assert len(heldout.load(job, target, [1, 3])) == 1
    changed = eval_job(tmp_path, f"eval.features_dir={tmp_path}/heldout", "eval.max_prompts=1",
                       "data.enable_thinking=true")
    with pytest.raises(CacheError, match="enable_thinking: False there, True now"):
        heldout.load(changed, target, [1, 3])
    batched = eval_job(tmp_path, f"eval.features_dir={tmp_path}/batched", "eval.max_prompts=1",
                       "eval.completions_batch_size=4")
    heldout.prepare(batched, target, [1, 3], Dist())
    alone = eval_job(tmp_path, f"eval.features_dir={tmp_path}/batched", "eval.max_prompts=1",
                     "eval.completions_batch_size=1")
    with pytest.raises(CacheError, match="completions_batch_size: 4 there, None now"):  # a key only one side has
        heldout.load(alone, target, [1, 3])


def test_in_run_evaluation_refuses_a_heldout_set_from_other_kernels(trained, tmp_path, tiny_targets):
    """Offline training loads the heads only and sees no kernels: the two manifests are compared."""
    from dflash.evaluate.heldout import heldout_paths
    from dflash.target import resolve_layer_ids

    tmp, _ = trained
    for d in tmp.iterdir():  # the training cache and the held-out sets, not the runs
        if d.name != "runs":
            shutil.copytree(d, tmp_path / d.name)
    job = eval_job(tmp_path, "run.name=k1", "train.max_steps=1")
    manifest_path = heldout_paths(job, tiny_targets["tiny_qwen3"], resolve_layer_ids(job.layers, 8))[0] / "manifest.json"
    assert manifest_path.exists()
    manifest = json.loads(manifest_path.read_text())
    manifest["kernel_backend"] = "full_attention=flash_attention_2"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ProvenanceError, match=r"(?s)held-out features.*kernel_backend: .*sdpa.*flash_attention_2"):
        train(job)
    train(eval_job(tmp_path, "run.name=k2", "train.max_steps=1", "provenance.allow_mismatch=[kernel_backend]"))


FLA = "causal_conv1d=causal_conv1d,full_attention=sdpa,linear_attention=fla"


def test_a_complete_heldout_set_evaluates_with_the_heads_alone(tmp_path, monkeypatch):
    """Features extracted on a GPU machine with fla kernels, evaluated on this CPU machine: the
    decoder layers are never loaded, and a held-out set from the fallback kernels is refused."""
    from dflash.target import loading

    run = train(eval_job(tmp_path, "run.name=h", "train.max_steps=2", target="tiny_qwen3_5"))
    [heldout_manifest] = tmp_path.glob("cache/eval-*/features-*/manifest.json")  # beside the training features
    fallback = json.loads(heldout_manifest.read_text())["kernel_backend"]
    assert "linear_attention=torch_fallback" in fallback
    for path in (heldout_manifest, run / "checkpoints/step-000002/train_state/manifest.json"):
        manifest = json.loads(path.read_text())
        manifest["kernel_backend"] = FLA  # as if both had been made on the GPU machine
        path.write_text(json.dumps(manifest))

    def no_decoder(*args, **kwargs):
        raise AssertionError("the decoder layers were loaded")

    monkeypatch.setattr(loading, "_load_model", no_decoder)
    job = eval_job(tmp_path, "run.name=h", "checkpoint=latest", target="tiny_qwen3_5")
    metrics = evaluate(job)
    assert metrics["eval/blocks"] > 0 and metrics["eval/tau"] >= 1.0
    manifest = json.loads(heldout_manifest.read_text())
    manifest["kernel_backend"] = fallback
    heldout_manifest.write_text(json.dumps(manifest))
    with pytest.raises(ProvenanceError, match=r"(?s)kernel_backend: .*linear_attention=fla.*torch_fallback"):
        evaluate(job)


def test_eval_dtype_is_the_targets_unless_asked_and_is_recorded(trained):
    """auto = the target's dtype (float32 for the tiny target); bfloat16 on request, close to it, beside the run's own
    float32 evaluation (another setting: its own folder)."""
    tmp, run = trained
    auto = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval.plots=false"))
    assert json.loads((run / "eval" / "step-000004" / "summary.json").read_text())["dtype"] == "float32"
    bf16 = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval.plots=false", "eval.dtype=bfloat16"))
    assert json.loads((run / "eval" / "step-000004-bfloat16" / "summary.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((run / "eval" / "step-000004" / "summary.json").read_text())["dtype"] == "float32"
    assert bf16["eval/blocks_all_anchors"] == auto["eval/blocks_all_anchors"]
    assert abs(bf16["eval/tau_all_anchors"] - auto["eval/tau_all_anchors"]) < 0.25


def test_a_suite_reports_each_benchmark_the_mean_prompts_and_references(trained, tmp_path, capsys, fake_wandb):
    """eval.suite.name on small files of every format (jsonl, parquet, a datasets folder): per-benchmark rows and
    outputs, the mean over benchmarks, best and worst prompts, reference rows marked where settings differ, and
    the same in the training run's W&B run."""
    from tests.evaluate.test_suites import write_benchmarks

    tmp, run = trained
    copy = tmp / "runs" / "r1suite"
    shutil.copytree(run, copy)
    write_benchmarks(tmp_path / "bench")
    refs = tmp_path / "refs.yaml"
    refs.write_text("references:\n"
                    "  - {name: published, source: a model card, target: Qwen/Qwen3-8B, thinking: false, block_size: 8,"
                    " tau: {gsm8k: 6.5, humaneval: 5.5, mt_bench: 3.5}}\n"
                    "  - {name: same-setup, source: a paper table, target: tiny_qwen3, block_size: 8, tau: {gsm8k: 2.0}}\n")
    other = tmp_path / "other_drafter"  # an eval.compare drafter, side by side on every benchmark
    shutil.copytree(run / "checkpoints" / "step-000002", other, ignore=shutil.ignore_patterns("train_state"))
    metrics = evaluate(eval_job(tmp, "run.name=r1suite", "checkpoint=step4", "logger=wandb_offline",
                                "eval.suite.name=gsm8k+humaneval+mt_bench",
                                f"eval.suite.benchmarks_dir={tmp_path}/bench",
                                f"eval.suite.references={refs}", f"eval.compare=[{other}]"))
    benches = ["gsm8k", "humaneval", "mt_bench"]
    out = copy / "eval" / "step-000004-suite-gsm8k+humaneval+mt_bench-from-bench"  # beside the in-run one
    summary = json.loads((out / "summary.json").read_text())
    for b in benches:
        one = json.loads((out / b / "summary.json").read_text())
        # MT-Bench: both turns, each a request (protocol zlab)
        assert one["benchmark"] == b and one["metrics"]["eval/prompts"] == (4 if b == "mt_bench" else 2)
        assert metrics[f"eval/{b}/tau"] == one["metrics"]["eval/tau"] >= 1.0  # the walk, as decoding sees it
        assert (out / b / "blocks.jsonl").exists() and (out / b / "tau_histogram.png").exists()
        anchors = [json.loads(x)["anchor"] for x in (out / b / "blocks.jsonl").read_text().splitlines()]
        theirs = out / "compare" / "other_drafter" / b / "blocks.jsonl"
        assert anchors == [json.loads(x)["anchor"] for x in theirs.read_text().splitlines()]
    compared = json.loads((out / "compare" / "other_drafter" / "summary.json").read_text())
    assert compared["benchmarks"] == benches and "eval/gap_tau" not in compared["metrics"]
    assert metrics["eval/mean/tau"] == pytest.approx(sum(metrics[f"eval/{b}/tau"] for b in benches) / 3)
    assert metrics["eval/mean/tau_all_anchors"] == pytest.approx(
        sum(metrics[f"eval/{b}/tau_all_anchors"] for b in benches) / 3)
    assert summary["metrics"] == metrics and summary["benchmarks"] == benches
    assert metrics["eval/gap_tau"] == pytest.approx(metrics["eval/mean/tau_all_anchors"] / metrics["eval/train_tau"])
    prompts = summary["prompts"]
    assert {p["prompt_id"] for p in prompts if p["benchmark"] == "mt_bench"} == {"81", "81:turn2", "82", "82:turn2"}
    assert len(prompts) == 8 and [p["tau"] for p in prompts] == sorted((p["tau"] for p in prompts), reverse=True)
    assert {p["benchmark"] for p in prompts} == set(benches) and "HumanEval/0" in {p["prompt_id"] for p in prompts}
    [published, same] = summary["references"]
    # the default protocol (zlab) leaves thinking to the chat template: a reference measured without it differs
    assert published["differs"] == [f"target Qwen/Qwen3-8B (ours {compose_target_path()})",
                                    "thinking off (ours the chat template's default)"] and same["differs"] == []
    assert published["mean"] == pytest.approx((6.5 + 5.5 + 3.5) / 3) and same["covers"] == 1
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert any(line.startswith("gsm8k") and "step4" in line for line in lines)
    assert any(line.startswith("gsm8k") and "other_drafter" in line for line in lines)
    assert any(line.startswith("mean (3)") and "other_drafter" in line for line in lines)
    assert any(line.startswith("humaneval") and "published *" in line and "5.500" in line for line in lines)
    assert any(line.startswith("mean (3)") and "step4" in line and f"{metrics['eval/mean/tau']:.3f}" in line
               for line in lines)
    assert any(line.startswith("mean (3)") and "same-setup (1 of 3)" in line for line in lines)
    assert "published *: a model card; settings differ: target Qwen/Qwen3-8B" in printed
    best, worst = prompts[0], prompts[-1]
    assert f"best prompts {best['benchmark']}/{best['prompt_id']} {best['tau']:.2f}" in printed
    assert f"worst {worst['benchmark']}/{worst['prompt_id']} {worst['tau']:.2f}" in printed
    assert "step4 (gsm8k+humaneval+mt_bench mean): held-out every-anchor tau" in printed
    eval_run = fake_wandb["runs"][-1]
    [scalars] = [d for d in eval_run.logged if "eval/gsm8k/tau" in d]
    assert scalars["train/step"] == 4 and scalars["eval/mean/tau"] == metrics["eval/mean/tau"]
    assert "eval/tau" not in scalars and eval_run.summary == {}  # the best single-set tau is not this suite's mean
    [tables] = [d for d in eval_run.logged if "eval/prompts" in d]
    assert len(tables["eval/prompts"].data) == 8 and tables["eval/prompts"].columns[:3] == ["benchmark", "prompt_id", "tau"]
    assert [row[0] for row in tables["eval/benchmarks"].data] == benches
    assert tables["eval/benchmarks"].data[1][2] == 5.5  # the published figure beside ours


def compose_target_path() -> str:
    return compose("evaluate", ["debug=tiny"]).target.path


def test_a_suite_in_live_mode_reports_tokens_per_forward_per_benchmark(trained, tmp_path, capsys):
    tmp, run = trained
    metrics = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval=live", "eval.max_new_tokens=8",
                                "eval.ddtree_budgets=[]", "eval.suite.name=coding", "eval.max_prompts=2"))
    assert metrics["eval/coding/live_tokens"] == 16 and metrics["eval/mean/live_tau"] == metrics["eval/coding/live_tau"]
    assert metrics["eval/mean/live_tokens_per_forward"] == metrics["eval/coding/live_tokens_per_forward"]
    out = run / "eval" / "step-000004-live-suite-coding-8tokens-ddtree-none"  # the run's: no suite, 40 tokens, [2, 8]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["prompts"]) == 2 and all(p["blocks"] >= 1 for p in summary["prompts"])
    printed = capsys.readouterr().out
    assert "tok/forward" in printed and any(line.startswith("coding") for line in printed.splitlines())


def test_expected_acceptance_at_temperature_zero_is_the_greedy_tau(trained):
    """Teacher-forced at eval.decode.temperature > 0: alpha per slot and the expected walk tau; as T -> 0 (1e-6: the
    tiny target's sampled completions are its greedy ones, alpha is 0 or 1) it is the greedy walk's tau."""
    tmp, _ = trained
    cold = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval.decode.temperature=1e-6",
                             "eval.plots=false"))
    assert cold["eval/tau_expected"] == pytest.approx(cold["eval/tau"], abs=1e-6)
    assert cold["eval/tau_alpha_product"] == pytest.approx(cold["eval/tau"], abs=1e-6)
    assert cold["eval/alpha@1"] == pytest.approx(cold["eval/acc@1"], abs=1e-6)
    warm = evaluate(eval_job(tmp, "run.name=r1", "checkpoint=step4", "eval.decode.temperature=1.0",
                             "eval.decode.top_k=20", "eval.plots=false"))
    assert 1.0 <= warm["eval/tau_expected"] < 8 and 0 <= warm["eval/alpha@1"] <= 1 and warm["eval/tau_expected_se"] > 0
    # a sampled evaluation has a folder of its own and logs under eval/<tag>/: never on the greedy eval/tau curve
    run = tmp / "runs" / "r1"
    assert (run / "eval" / "step-000004-t1-k20" / "summary.json").exists()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/t1-k20/tau_expected" in r for r in logged)
    assert not any("eval/tau_expected" in r for r in logged)


def test_a_greedy_heldout_set_is_refused_at_temperature(trained, tiny_targets):
    tmp, _ = trained
    job = eval_job(tmp, "eval.max_prompts=1")
    target = tiny_targets["tiny_qwen3"]
    heldout.prepare(job, target, [1, 3], Dist())
    greedy = heldout.load(job, target, [1, 3])
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(ids=[1, 3]), target)
    hot = replace(job.eval, decode=replace(job.eval.decode, temperature=0.7))
    with pytest.raises(CacheError, match="stores none"):
        teacher_forced(drafter, target.embed_tokens, target.lm_head, greedy, hot)
    paths = heldout.heldout_paths(replace(job, eval=hot), target, [1, 3]), heldout.heldout_paths(job, target, [1, 3])
    assert paths[0][0] != paths[1][0]  # a sampled held-out set is a set of its own


def test_the_sampling_tag_names_a_truncated_selector_apart():
    """eval.decode.selector_truncation changes DFlash 2's draft distribution only where top-p or top-k truncate: the
    metrics' namespace says so then, and only then."""
    from dflash.config import DecodeConfig
    from dflash.evaluate.settings import sampling_tag

    assert sampling_tag(DecodeConfig(temperature=1.0, top_p=0.9)) == "t1-p0.9"
    assert sampling_tag(DecodeConfig(temperature=1.0, top_p=0.9, selector_truncation=True)) == "t1-p0.9-sel"
    assert sampling_tag(DecodeConfig(temperature=1.0, selector_truncation=True)) == "t1"
    assert sampling_tag(DecodeConfig(selector_truncation=True)) == ""
    assert sampling_tag(DecodeConfig(temperature=0.6, selector_draw="vocabulary")) == "t0.6-vocabulary"
