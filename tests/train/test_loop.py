"""The training loop on the tiny targets: learning, checkpoints, resume, noise, bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.drafter.recompute import compile_layers, use_checkpointing
from dflash.errors import ConfigError, TrainingError
from dflash.layout import CheckpointLayout, RunLayout
from dflash.train import loop as training
from dflash.train import step as stepping
from dflash.train.loop import train
from tests.conftest import compose, tiny_job


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


def job_for(workdir: Path, name: str, *overrides: str, target="tiny_qwen3_5"):
    return tiny_job("train", workdir, "eval.max_prompts=3", "optim.lr=3e-3", *overrides, target=target, name=name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_parameters_change_and_files_are_written(workdir):
    # a random-weight target's lm_head has tiny logits, so learning is slow; memorising four
    # sequences shows the signal within seconds
    run = train(job_for(workdir, "learn", "train.max_steps=40", "train.save_every=10", "train.keep_last=2",
                        "train.batch_size=4", "data.limit=4", "train.num_anchors=64", "optim.lr=1e-2",
                        "optim.schedule=constant", f"features.dir={workdir}/cache4/features"))
    ckpts = RunLayout(run).list_checkpoints()
    assert [s for s, _ in ckpts] == [30, 40]  # keep_last=2
    # the documented run layout, exactly (no wandb/ with logger=none)
    assert {p.name for p in run.iterdir()} == {"config.yaml", "run.json", "metrics.jsonl", "train.log",
                                               "checkpoints", "eval"}
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"step-000030", "step-000040", "best.json"}
    final = ckpts[-1][1]
    for ckpt in (ckpts[0][1], final):
        assert {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} == CheckpointLayout(ckpt).files()
    assert {p.name for p in (run / "eval").iterdir()} == {"step-000000", "step-000040"}
    assert {p.name for p in (run / "eval" / "step-000040").iterdir()} == {"summary.json", "blocks.jsonl"}
    rows = [r for r in metrics(run) if "train/loss" in r]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    first, last = sum(r["train/loss"] for r in rows[:5]) / 5, sum(r["train/loss"] for r in rows[-5:]) / 5
    assert last < first - 0.4, (first, last)
    assert rows[-1]["train/tau"] > rows[0]["train/tau"] + 0.3
    for key in ("train/acc@1", "train/acc@7", "train/streak", "train/tau", "train/lr", "train/grad_norm",
                "train/tokens_per_s", "train/anchors_per_s", "train/peak_memory_gb"):
        assert key in rows[-1]
    init = load_file(ckpts[0][1] / "model.safetensors")
    end = load_file(final / "model.safetensors")
    assert any(not torch.equal(init[k], end[k]) for k in end)
    assert set(end) == set(init) and not any(k.startswith(("embed", "lm_head")) for k in end)
    # servable weights in bf16 (as published drafters ship), the float32 ones kept for resuming
    exact = load_file(final / "train_state/weights_fp32.safetensors")
    assert all(v.dtype == torch.bfloat16 and exact[k].dtype == torch.float32 for k, v in end.items())
    assert all(torch.equal(exact[k].to(torch.bfloat16), v) for k, v in end.items())
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "bfloat16"
    evals = [r for r in metrics(run) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [0, 40] and (run / "eval" / "step-000040" / "summary.json").exists()


def assert_resume_reproduces(workdir, monkeypatch, name: str, common: tuple, steps: int, cut: int) -> None:
    """A run stopped right after its checkpoint at step `cut` and resumed ends with bit-identical float32
    weights and the same logged losses as the run that never stopped."""
    full = train(job_for(workdir, f"{name}-full", *common))
    original = training.save

    def save_then_die(cfg, shrink, acc, m, run, state, *args):
        original(cfg, shrink, acc, m, run, state, *args)
        if state.step == cut:
            raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(training, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(job_for(workdir, f"{name}-cut", *common))
    monkeypatch.setattr(training, "save", original)
    resumed = train(job_for(workdir, f"{name}-cut", *common, "train.resume=latest"))
    final = f"checkpoints/step-{steps:06d}/train_state/weights_fp32.safetensors"
    a, b = load_file(full / final), load_file(resumed / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    loss = lambda run: {r["step"]: r["train/loss"] for r in metrics(run) if "train/loss" in r}  # noqa: E731
    assert loss(full) == loss(resumed)


def test_resume_reproduces_the_uninterrupted_run(workdir, monkeypatch):
    assert_resume_reproduces(workdir, monkeypatch, "adamw", ("train.max_steps=8", "train.save_every=4",
                             "noise=gaussian", "train.batch_size=2"), steps=8, cut=4)


def test_noise_reaches_the_drafter_input_only(workdir, monkeypatch):
    seen = {}
    real_draft, real_loss = stepping.draft_packed, stepping.block_terms

    def spy_draft(drafter, embed, features, blocks, backend, **kwargs):
        seen.setdefault("features", []).append(features.clone())
        return real_draft(drafter, embed, features, blocks, backend, **kwargs)

    def spy_loss(hidden, weight, labels, mask, gamma, chunk, **kwargs):
        seen.setdefault("labels", []).append(labels.clone())
        return real_loss(hidden, weight, labels, mask, gamma, chunk, **kwargs)

    monkeypatch.setattr(stepping, "draft_packed", spy_draft)
    monkeypatch.setattr(stepping, "block_terms", spy_loss)
    train(job_for(workdir, "clean", "train.max_steps=2"))
    clean = dict(seen)
    seen.clear()
    train(job_for(workdir, "noisy", "train.max_steps=2", "noise=uniform", "noise.scale=0.5"))
    for c, n in zip(clean["labels"], seen["labels"]):
        assert torch.equal(c, n)
    for c, n in zip(clean["features"], seen["features"]):
        assert c.shape == n.shape and not torch.allclose(c, n)
        rel = ((n - c).norm() / c.norm()).item()
        assert 0.05 < rel < 0.6, rel


def test_nan_loss_stops_with_step_and_batch_and_keeps_the_checkpoint(workdir, monkeypatch):
    real = stepping.block_terms
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        terms = real(*args, **kwargs)
        terms.loss_sum = terms.loss_sum * float("nan") if calls["n"] == 6 else terms.loss_sum
        return terms

    monkeypatch.setattr(stepping, "block_terms", poisoned)
    with pytest.raises(TrainingError, match=r"non-finite loss .* at step 6 .*sequences \['tiny-.*untouched"):
        train(job_for(workdir, "nan", "train.max_steps=10", "train.save_every=4"))
    run = workdir / "runs" / "nan"
    assert [s for s, _ in RunLayout(run).list_checkpoints()] == [4]
    assert load_file(run / "checkpoints/step-000004/model.safetensors")


def test_offline_cache_with_other_layers_is_refused(workdir):
    train(job_for(workdir, "layers-a", "train.max_steps=1"))
    with pytest.raises(ConfigError, match=r"holds layers \[1, 2, 3, 4, 5\] but the drafter reads \[1, 3, 5\]"):
        train(job_for(workdir, "layers-b", "train.max_steps=1", "layers.num=3"))


def test_cache_of_other_data_is_refused_naming_the_difference(workdir, caplog):
    """A cache extracted with data.limit=3 is not trained on by a run that asks for 4 prompts (or another
    template); where the prompts cannot be read again, the cache is used as it is, with a warning."""
    from dflash.errors import CacheError

    cache = f"features.dir={workdir}/cache-data/features"
    train(job_for(workdir, "three", "train.max_steps=1", "data.limit=3", cache))
    with pytest.raises(CacheError, match=r"num_prompts: 3 there, 4 now.*Delete that folder"):
        train(job_for(workdir, "four", "train.max_steps=1", "data.limit=4", cache))
    with pytest.raises(CacheError, match=r"chat_template: True there, False now"):
        train(job_for(workdir, "plain", "train.max_steps=1", "data.limit=3", "data.chat_template=false", cache))
    train(job_for(workdir, "same", "train.max_steps=1", "data.limit=3", cache))  # the same data: trains
    assert (workdir / "runs/same/checkpoints").is_dir()
    with caplog.at_level("WARNING"):
        train(job_for(workdir, "gone", "train.max_steps=1", f"data.prompts={workdir}/missing.jsonl", cache))
    assert "could not read data.prompts" in caplog.text


def test_existing_run_is_not_overwritten(workdir):
    train(job_for(workdir, "once", "train.max_steps=1"))
    before = (workdir / "runs/once/checkpoints/step-000001/model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already has checkpoints.*train.resume=latest"):
        train(job_for(workdir, "once", "train.max_steps=1"))
    assert (workdir / "runs/once/checkpoints/step-000001/model.safetensors").read_bytes() == before


def test_online_mode_matches_offline_mode(workdir):
    """Online features come from the same feature function as the cache: same losses."""
    off = train(job_for(workdir, "off", "train.max_steps=3", "train.mode=offline", "features.storage=float32",
                        f"features.dir={workdir}/cache32/features"))
    on = train(job_for(workdir, "on", "train.max_steps=3", "train.mode=online",
                       f"features.dir={workdir}/cache32/features"))
    a = [r["train/loss"] for r in metrics(off) if "train/loss" in r]
    b = [r["train/loss"] for r in metrics(on) if "train/loss" in r]
    assert len(a) == 3 and all(abs(x - y) < 1e-4 for x, y in zip(a, b)), (a, b)


def test_cache_of_another_target_is_refused(workdir):
    from dflash.errors import ProvenanceError

    train(job_for(workdir, "q3", "train.max_steps=1", f"features.dir={workdir}/cache-q3/features",
                  target="tiny_qwen3"))
    with pytest.raises(ProvenanceError, match=r"(?s)target: .*in target tiny_qwen3_5.*in the feature cache.*"
                                              r"allow_mismatch=\[target\]"):
        train(job_for(workdir, "q35-on-q3", "train.max_steps=1", f"features.dir={workdir}/cache-q3/features"))


@pytest.mark.slow
def test_compiled_drafter_trains_and_saves_the_zlab_layout(workdir, monkeypatch):
    """train.compile=model wraps the drafter (OptimizedModule, its weights under _orig_mod.): the checkpoint keeps
    the z-lab names. aot_eager, as for compiled layers: inductor's code generation took 50-80 s here."""
    from functools import partial

    from dflash.drafter.build import load_drafter

    monkeypatch.setattr(training.torch, "compile", partial(torch.compile, backend="aot_eager"))
    run = train(job_for(workdir, "compiled", "train.max_steps=2", "train.compile=model"))
    ckpt = run / "checkpoints/step-000002"
    assert all(not k.startswith("_orig_mod") for k in load_file(ckpt / "model.safetensors"))
    assert load_drafter(str(ckpt)).target_layer_ids == [1, 2, 3, 4, 5]


def test_flex_attention_on_a_cpu_is_refused_before_any_work(workdir):
    job = job_for(workdir, "flexcpu", "train.attention=flex", f"features.dir={workdir}/flexcpu/features")
    with pytest.raises(ConfigError, match="train.attention=flex needs a CUDA device.*train.attention=sdpa"):
        train(job)
    assert not (workdir / "flexcpu").exists() and not (workdir / "runs" / "flexcpu").exists()


def test_compiled_layers_train_and_save_the_zlab_layout(workdir, monkeypatch):
    """train.compile=layers compiles the drafter's training call of a layer (aot_eager here: inductor's code
    generation would take a minute on this CPU): the run trains with selective checkpointing through it, and its
    weights keep their names."""
    
    compiled = []
    monkeypatch.setattr(training, "compile_layers", lambda d: (compiled.append(d), compile_layers(d, "aot_eager")))
    run = train(job_for(workdir, "layers", "train.max_steps=2", "train.compile=layers",
                        "train.gradient_checkpointing=selective", "eval.at_start=false"))
    [drafter] = compiled
    assert hasattr(drafter.train_layer, "_torchdynamo_orig_callable")  # the compiled training call
    names = set(load_file(run / "checkpoints/step-000002/model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in names and not any("_orig_mod" in k for k in names)
    with pytest.raises(Exception, match="train.compile='yes' is not valid; expected one of off, layers, model"):
        compose("train", ["train.compile=yes"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradient_checkpointing_trains(workdir, monkeypatch, mode):
    used = []
    monkeypatch.setattr(training, "use_checkpointing", lambda d, m: (used.append(m), use_checkpointing(d, m)))
    run = train(job_for(workdir, f"ckpting-{mode}", "train.max_steps=3", f"train.gradient_checkpointing={mode}",
                        "eval.at_start=false"))
    assert [s for s, _ in RunLayout(run).list_checkpoints()] == [3]
    assert used == [mode]
    assert json.loads(RunLayout(run).info.read_text())["gradient_checkpointing"] == mode  # resolved once, recorded
