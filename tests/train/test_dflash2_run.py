"""A DFlash 2 run end to end on a tiny target: the joint loss logged in both parts, the selector trained,
teacher-forced selector/unary/oracle taus, a DFlash2DraftModel checkpoint that evaluates live, losslessly,
and resumes."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from dflash.errors import ConfigError
from dflash.evaluate.runner import evaluate
from dflash.layout import RunLayout
from dflash.train.loop import train
from tests.conftest import tiny_job
from tests.train.test_loop import job_for, metrics


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash2")


def test_a_dflash2_run_trains_both_parts_and_evaluates_its_selector(workdir):
    overrides = ("drafter=dflash2", "drafter.num_layers=2", "drafter.selector_rank=32", "train.max_steps=12",
                 "train.save_every=6", "train.batch_size=4", "data.limit=4", "optim.lr=1e-2", "eval.ddtree_budgets=[4]")
    run = train(job_for(workdir, "d2", *overrides, target="tiny_qwen3"))
    rows = [r for r in metrics(run) if "train/loss" in r]
    for key in ("train/selector_loss", "train/tau", "train/acc@1", "train/unary/tau", "train/unary/acc@1",
                "train/oracle/tau", "train/oracle/acc@1", "train/topk_recall"):
        assert key in rows[-1] and torch.isfinite(torch.tensor(rows[-1][key])), key
    for row in rows:  # served semantics: the selector is right only where the unary top-K holds the gold token
        assert row["train/tau"] <= row["train/oracle/tau"] and row["train/acc@1"] <= row["train/oracle/acc@1"]
        assert 0 <= row["train/topk_recall"] <= 1
    assert rows[-1]["train/selector_loss"] < rows[0]["train/selector_loss"]
    ckpts = RunLayout(run).list_checkpoints()
    first, last = (load_file(c / "model.safetensors") for _, c in (ckpts[0], ckpts[-1]))
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight",
                 "layers.0.attention_conv.kernel_projection.weight", "layers.1.mlp_conv.base_kernel"):
        assert not torch.equal(first[name], last[name]), name
    config = json.loads((ckpts[-1][1] / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 16
    assert json.loads((run / "run.json").read_text())["conv_kernel"] == "torch"  # train.conv_kernel=auto on a CPU
    summary = json.loads((run / "eval" / "step-000012" / "summary.json").read_text())["metrics"]
    for key in ("eval/tau", "eval/tau_unary", "eval/tau_oracle", "eval/ddtree@4", "eval/ddtree_pair@4",
                "eval/acc@1", "eval/unary_acc@1"):
        assert key in summary, key
    assert summary["eval/tau_oracle"] >= summary["eval/tau"]  # gold among the candidates bounds the selector

    job = tiny_job("evaluate", workdir, *overrides, "checkpoint=latest", "eval=live", "eval.ddtree_budgets=[4]",
                   "eval.max_prompts=2", "eval.max_new_tokens=24", "eval.decode.selector_beam=3", target="tiny_qwen3",
                   name="d2")
    live = evaluate(job)  # check_lossless raises on any divergence
    for key in ("eval/live_tau", "eval/live_ddtree@4_tau", "eval/live_ddtree_pair@4_tau", "eval/live_beam_tau",
                "eval/live_tokens_per_forward"):
        assert key in live, key

    resumed = train(job_for(workdir, "d2", *overrides, "train.max_steps=14", "train.resume=latest", target="tiny_qwen3"))
    assert RunLayout(resumed).list_checkpoints()[-1][0] == 14


def test_fine_tuning_a_dflash2_checkpoint_needs_its_kind(workdir):
    ckpt = RunLayout(workdir / "runs" / "d2").list_checkpoints()[-1][1]
    with pytest.raises(ConfigError, match="is a dflash2 drafter but drafter.kind=dflash: set drafter.kind=dflash2"):
        train(job_for(workdir, "ft", f"drafter.init_from={ckpt}", "train.max_steps=1", "data.limit=4", target="tiny_qwen3"))
    run = train(job_for(workdir, "ft", f"drafter.init_from={ckpt}", "drafter.kind=dflash2", "train.max_steps=1",
                        "data.limit=4", "eval.at_start=true", target="tiny_qwen3"))
    start = json.loads((run / "eval" / "step-000000" / "summary.json").read_text())["metrics"]
    end = json.loads((workdir / "runs" / "d2" / "eval" / "step-000012" / "summary.json").read_text())["metrics"]
    assert start["eval/tau"] == pytest.approx(end["eval/tau"])  # it starts from the checkpoint's weights


def test_the_zlab_reference_decodes_our_dflash2_checkpoint_as_we_do(workdir, tiny_targets, monkeypatch):
    """Greedy decoding with the reference's DFlash2DraftModel and dflash_generate on our trained checkpoint: the
    same tokens and the same acceptance length at every step as our speculative_generate."""
    from dflash.drafter.build import load_drafter
    from dflash.drafter.decoding.engine import speculative_generate
    from tests.zlab import reference

    ref = reference()
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs
    target = tiny_targets["tiny_qwen3"]
    ckpt = RunLayout(workdir / "runs" / "d2").list_checkpoints()[-1][1]
    ours, theirs = load_drafter(str(ckpt)).float().eval(), ref.DFlash2DraftModel.from_pretrained(str(ckpt)).float().eval()
    from dflash.data.cache import FeatureCache

    cache = FeatureCache(workdir / "cache" / "tiny_qwen3" / "features")  # the prompts it trained on
    accepted = []
    for seed in range(len(cache)):
        seq, mask, _ = cache[seed]
        ids = seq[None, : int(mask.nonzero()[0])]
        mine = speculative_generate(ours, target, ids, 40)
        out = ref.dflash_generate(theirs, target.model, ids, 40, stop_token_ids=None, return_stats=True)
        assert torch.equal(out.output_ids, mine.output_ids), seed
        assert out.acceptance_lengths == mine.acceptance_lengths, seed
        accepted += mine.acceptance_lengths
    assert max(accepted) > 1  # some drafts accepted: the selector's path was compared


SMALL = ("drafter=dflash2", "drafter.num_layers=1", "drafter.selector_rank=8", "data.limit=4", "eval.every=0")


@pytest.mark.parametrize("gold", ["inject", "strict"])
def test_the_selector_weight_reaches_the_step_scheduled_and_normalised(workdir, monkeypatch, gold):
    """The gradient each micro-batch's selector sum gets is the scheduled weight (0, 0, 1, 2 over 4 steps: warmup
    0.25, ramp 0.5, weight 2) over its normaliser: the whole step's decay weights with gold=inject (both
    micro-batches'), each micro-batch's own counted weights with strict (then averaged over the 2)."""
    from dflash.train import step as stepping

    seen, real = [], stepping.block_terms

    def spy(*args, **kwargs):
        terms = real(*args, **kwargs)
        record = {"weight": terms.selector_weight_sum.item()}
        terms.selector_sum.register_hook(lambda g: record.update(scale=g.item()))
        seen.append(record)
        return terms

    monkeypatch.setattr(stepping, "block_terms", spy)
    train(job_for(workdir, f"schedule-{gold}", *SMALL, "train.max_steps=4", "train.batch_size=1",
                  "train.grad_accum=2", "train.save_every=4", "loss.selector.weight=2", f"loss.selector.gold={gold}",
                  "drafter.selector_top_k=128",  # of 262 tokens: most, not all, gold tokens among the candidates
                  "loss.selector.warmup_ratio=0.25", "loss.selector.ramp_ratio=0.5", target="tiny_qwen3"))
    assert len(seen) == 8
    for step, weight in enumerate([0.0, 0.0, 1.0, 2.0]):
        a, b = seen[2 * step: 2 * step + 2]
        expected = [weight / (a["weight"] + b["weight"])] * 2 if gold == "inject" else [
            weight / (2 * a["weight"]), weight / (2 * b["weight"])]
        assert [a["scale"], b["scale"]] == pytest.approx(expected, rel=1e-6), step
        assert a["weight"] > 0 and b["weight"] > 0


def test_the_selector_choices_reach_the_loss_and_the_run_records_them(workdir, monkeypatch):
    """Online, D-PACE: the loss gets the options and the target's argmax as the selector's gold tokens; the run's
    config.yaml holds the keys; a zero successor codebook stays 0 while the weight is 0 (warmup: no gradient, and
    decay keeps a zero) and trains after it."""
    from dflash.drafter.selector_loss import SelectorOptions
    from dflash.train import step as stepping

    seen, real = [], stepping.block_terms

    def spy(*args, **kwargs):
        seen.append((kwargs["selector_options"], kwargs.get("selector_labels"), kwargs["rows"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(stepping, "block_terms", spy)
    keys = ("loss.selector.gradient=coupled", "loss.selector.gold=strict", "loss.selector.weights=follow",
            "loss.selector.labels=target", "loss.selector.init=zero", "loss.selector.dropout=0.1",
            "loss.selector.decay=0.5", "loss.selector.warmup_ratio=0.5")
    run = train(job_for(workdir, "choices", *SMALL, "loss=dpace", "train.mode=online", "train.max_steps=4",
                        "train.save_every=2", "train.batch_size=2", *keys, target="tiny_qwen3"))
    assert {options for options, _, _ in seen} == {SelectorOptions("coupled", "strict", 0.1, "follow", 0.6)}
    assert all(labels is not None and labels.shape == rows.shape for _, labels, rows in seen)
    recorded = (run / "config.yaml").read_text()
    for key in keys:
        name, value = key.removeprefix("loss.selector.").split("=")
        assert f"\n    {name}: {value}\n" in "\n" + recorded.split("\n  selector:\n", 1)[1], key  # loss.selector
    successor = [load_file(c / "model.safetensors")["candidate_selector.successor_codebook"]
                 for _, c in RunLayout(run).list_checkpoints()]
    assert not successor[0].any() and successor[1].any()
    assert all(torch.isfinite(torch.tensor(r["train/selector_loss"])) for r in metrics(run) if "train/loss" in r)


def test_the_target_argmax_labels_offline_equal_online_and_need_a_topk_cache(workdir):
    """loss.selector.labels=target reads the target's argmax from its logits online and from the first of the
    cache's stored top-k offline: the same run (float32 features), not the data labels' run (sampled completions:
    the target's argmax is not always the token that follows); a cache without them is refused."""
    common = (*SMALL, "train.max_steps=3", "train.batch_size=2", "features.storage=float32",
              "data.completions.temperature=1.0", f"features.dir={workdir}/cache-top4/features")
    target = ("loss.selector.labels=target",)
    off = train(job_for(workdir, "argmax-off", *common, *target, "features.topk_logits=4", target="tiny_qwen3"))
    on = train(job_for(workdir, "argmax-on", *common, *target, "train.mode=online", target="tiny_qwen3"))
    data = train(job_for(workdir, "argmax-data", *common, "train.mode=online", target="tiny_qwen3"))
    a, b, c = ([r["train/selector_loss"] for r in metrics(run) if "train/loss" in r] for run in (off, on, data))
    assert len(a) == 3 and a == pytest.approx(b, abs=1e-4) and a[0] != pytest.approx(c[0], abs=1e-2)
    with pytest.raises(ConfigError, match="loss.selector.labels=target needs the target's argmax.*train.mode=online"):
        train(job_for(workdir, "argmax-none", *SMALL, "loss.selector.labels=target", "train.max_steps=1",
                      target="tiny_qwen3"))


def test_the_codebook_span_holds_through_training_and_fsdp_is_refused(workdir, monkeypatch):
    """loss.selector.span=embedding: every checkpoint's codebooks lie in the span of the target's embeddings
    (predecessor) and head rows (successor), and training moved them; under FSDP (sharded codebooks) the key is
    refused before any data work."""
    from dflash.target.loading import load_target
    from dflash.train import loop

    job = job_for(workdir, "span", *SMALL, "train.max_steps=2", "train.save_every=1", "train.batch_size=2",
                  "loss.selector.span=embedding", target="tiny_qwen3")
    run = train(job)
    checkpoints = [load_file(c / "model.safetensors") for _, c in RunLayout(run).list_checkpoints()]
    assert len(checkpoints) == 2
    target = load_target(job.target, heads_only=True)
    for weights in checkpoints:
        for name, table in (("predecessor_codebook", target.embed_tokens.weight),
                            ("successor_codebook", target.lm_head.weight)):
            codebook, table = weights[f"candidate_selector.{name}"].float(), table.detach().float()
            least = table @ torch.linalg.lstsq(table, codebook).solution
            assert torch.allclose(codebook, least, atol=1e-4), name
    assert not torch.equal(checkpoints[0]["candidate_selector.predecessor_codebook"],
                           checkpoints[1]["candidate_selector.predecessor_codebook"])
    monkeypatch.setattr(loop, "is_fsdp", lambda acc: True)
    with pytest.raises(ConfigError, match="loss.selector.span=embedding projects whole codebooks.*selector.span=free"):
        train(job_for(workdir, "span-fsdp", *SMALL, "train.max_steps=1", "loss.selector.span=embedding",
                      target="tiny_qwen3"))


def test_a_shrunk_selector_is_what_the_checkpoint_serves_and_the_run_evaluates(workdir, monkeypatch):
    """loss.selector.shrink=0.5: the checkpoint's servable predecessor codebook is the trained one (its float32 copy,
    which a resume reads) times 0.5, every other weight as trained; the in-run evaluation scores that served
    codebook, and training goes on with the trained one (the resumed run's next checkpoint again serves half of its
    float32 copy)."""
    from dflash.layout import CheckpointLayout
    from dflash.train import loop as training  # train() calls its evaluate_in_run

    seen, real = [], training.evaluate_in_run

    def spy(job, drafter, *args, **kwargs):
        seen.append(drafter.candidate_selector.predecessor_codebook.detach().clone())
        return real(job, drafter, *args, **kwargs)

    monkeypatch.setattr(training, "evaluate_in_run", spy)
    overrides = (*SMALL, "train.batch_size=2", "train.save_dtype=float32", "loss.selector.shrink=0.5")
    run = train(job_for(workdir, "shrink", *overrides, "train.max_steps=2", target="tiny_qwen3"))
    train(job_for(workdir, "shrink", *overrides, "train.max_steps=3", "train.resume=latest", target="tiny_qwen3"))
    key = "candidate_selector.predecessor_codebook"
    checkpoints = [c for _, c in RunLayout(run).list_checkpoints()]
    assert len(checkpoints) == 2 and len(seen) == 3  # step 0 (debug=tiny evaluates at the start), 2 and 3
    for folder, evaluated in zip(checkpoints, seen[1:]):
        served = load_file(folder / "model.safetensors")
        trained = load_file(CheckpointLayout(folder).state_file(CheckpointLayout.EXACT_WEIGHTS))
        assert torch.equal(served[key], trained[key] * 0.5) and torch.equal(evaluated, served[key])
        assert all(torch.equal(served[k], trained[k]) for k in trained if k != key)


def test_the_shrink_sweep_serves_a_trained_run_at_another_shrink(workdir):
    """sweeps/selector_shrink.py's copy of a checkpoint (the previous test's run, trained at 0.5): its servable
    predecessor codebook is the float32 one times the new value, which its config.json records, every other weight
    the checkpoint's own."""
    import importlib.util

    from dflash.layout import CheckpointLayout
    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("selector_shrink", REPO / "sweeps" / "selector_shrink.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    checkpoint = RunLayout(workdir / "runs" / "shrink").list_checkpoints()[-1][1]
    copy = sweep.shrunk_copy(checkpoint, 0.25, workdir / "shrunk-0.25")
    key = "candidate_selector.predecessor_codebook"
    served, original = load_file(copy / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    trained = load_file(CheckpointLayout(checkpoint).state_file(CheckpointLayout.EXACT_WEIGHTS))
    assert torch.equal(served[key], trained[key] * 0.25)
    assert all(torch.equal(served[k], original[k]) for k in original if k != key)
    assert not (copy / "train_state").exists() and (copy / "config.json").exists()
    assert json.loads((copy / "config.json").read_text())["dflash_config"]["selector_shrink"] == 0.25


def test_fine_tuning_a_dflash2_checkpoint_starts_from_its_trained_selector(workdir, tiny_targets, monkeypatch):
    """drafter.init_from a DFlash 2 checkpoint trains on from its trained weights (train_state's float32 copy), not
    from the served ones, whose predecessor codebook carries loss.selector.shrink (issue 65): after one step at
    lr 1e-12 the fine-tune serves shrink x the trained codebook again (0.6, not 0.36), and its step-0 evaluation
    scores what the checkpoint serves. config.json records that shrink (dflash_config.selector_shrink): a copy
    without train_state/ starts from its served codebook divided by it, one without the key (a published drafter)
    from its weights as they are; evaluate.py's loading reads the served weights either way."""
    import shutil

    from dflash.drafter.build import build_drafter, load_drafter
    from dflash.layout import CheckpointLayout
    from dflash.train import loop as training  # train() calls its evaluate_in_run

    seen, real = [], training.evaluate_in_run

    def spy(job, drafter, *args, **kwargs):
        seen.append(drafter.candidate_selector.predecessor_codebook.detach().clone())
        return real(job, drafter, *args, **kwargs)

    monkeypatch.setattr(training, "evaluate_in_run", spy)
    key = "candidate_selector.predecessor_codebook"
    overrides = (*SMALL, "train.batch_size=2", "train.save_dtype=float32", "eval.at_start=true")
    base = RunLayout(train(job_for(workdir, "init-base", *overrides, "train.max_steps=2", target="tiny_qwen3")))
    checkpoint = base.list_checkpoints()[-1][1]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["dflash_config"]["selector_shrink"] == 0.6
    trained = load_file(CheckpointLayout(checkpoint).state_file(CheckpointLayout.EXACT_WEIGHTS))[key]
    served = load_file(checkpoint / "model.safetensors")[key]
    assert torch.equal(served, trained * 0.6)

    seen.clear()
    tuned = RunLayout(train(job_for(workdir, "init-tuned", *overrides, f"drafter.init_from={checkpoint}",
                                    "optim.lr=1e-12", "train.max_steps=1", target="tiny_qwen3")))
    final = tuned.list_checkpoints()[-1][1]
    again = load_file(final / "model.safetensors")[key]
    ratio = (again.double().norm() / trained.double().norm()).item()
    assert ratio == pytest.approx(0.6, rel=1e-6)  # 0.36 when the served codebook was taken as the trained one
    assert torch.allclose(load_file(CheckpointLayout(final).state_file(CheckpointLayout.EXACT_WEIGHTS))[key], trained,
                          rtol=1e-6, atol=1e-9)
    assert torch.allclose(seen[0], served, rtol=1e-6, atol=1e-9)  # step 0 scores what the checkpoint served
    assert json.loads((final / "config.json").read_text())["dflash_config"]["selector_shrink"] == 0.6

    target = tiny_targets["tiny_qwen3"]
    copy = workdir / "init-served-only"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(checkpoint, copy, ignore=shutil.ignore_patterns("train_state"))

    def start(folder):
        job = job_for(workdir, "unused", *SMALL, f"drafter.init_from={folder}", target="tiny_qwen3")
        return build_drafter(job.drafter, job.layers, target).candidate_selector.predecessor_codebook.detach()

    assert torch.allclose(start(copy), trained, rtol=1e-6, atol=1e-9)  # the served codebook / 0.6
    config["dflash_config"].pop("selector_shrink")
    (copy / "config.json").write_text(json.dumps(config))
    assert torch.equal(start(copy), served)  # no recorded shrink: as it is
    for folder in (checkpoint, copy):  # evaluation scores the served weights, whatever config.json records
        assert torch.equal(load_drafter(str(folder)).candidate_selector.predecessor_codebook.detach(), served)


def test_a_dflash2_run_under_bf16_autocast_evaluates_in_run(tmp_path):
    """train.mixed_precision=bf16 on a bf16 target: accelerate's autocast wrapper makes the drafter's forward return
    float32, and the in-run evaluation's bf16 selector refused it (a dtype error at step 0 of SmolLM2's DFlash 2
    run). The served copy evaluated in-run now runs its own forward, as evaluate.py does. In a process of its own:
    accelerate's state, once made without mixed precision by another test, refuses bf16 for the rest of the
    process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "train.py", "debug=tiny", "drafter.kind=dflash2", "drafter.num_layers=1",
           "drafter.selector_rank=16", "train.max_steps=2", "train.save_every=2", "train.mixed_precision=bf16",
           "target.dtype=bfloat16", "eval.ddtree_budgets=[4]", "logger=none", f"run.root={tmp_path}/runs",
           "run.name=d2bf16", f"features.dir={tmp_path}/features", f"data.completions.path={tmp_path}/c.jsonl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "d2bf16" / "eval" / "step-000002" / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["metrics"]["eval/tau"] >= 1.0
