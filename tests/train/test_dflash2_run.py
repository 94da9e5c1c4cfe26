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
from tests.conftest import compose
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
    summary = json.loads((run / "eval" / "step-000012" / "summary.json").read_text())["metrics"]
    for key in ("eval/tau", "eval/tau_unary", "eval/tau_oracle", "eval/ddtree@4", "eval/ddtree_pair@4",
                "eval/acc@1", "eval/unary_acc@1"):
        assert key in summary, key
    assert summary["eval/tau_oracle"] >= summary["eval/tau"]  # gold among the candidates bounds the selector

    job = compose("evaluate", ["debug=tiny", "target=tiny_qwen3", f"run.root={workdir}/runs", "run.name=d2",
                               *overrides, "checkpoint=latest", "eval=live", "eval.ddtree_budgets=[4]",
                               "eval.max_prompts=2", "eval.max_new_tokens=24",
                               f"features.dir={workdir}/cache/tiny_qwen3/tiny/features"])
    live = evaluate(job)  # check_lossless raises on any divergence
    for key in ("eval/live_tau", "eval/live_ddtree@4_tau", "eval/live_ddtree_pair@4_tau",
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
    from dflash.evaluate.decode import speculative_generate
    from tests.zlab import reference

    ref = reference()
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs
    target = tiny_targets["tiny_qwen3"]
    ckpt = RunLayout(workdir / "runs" / "d2").list_checkpoints()[-1][1]
    ours, theirs = load_drafter(str(ckpt)).float().eval(), ref.DFlash2DraftModel.from_pretrained(str(ckpt)).float().eval()
    from dflash.data.cache import FeatureCache

    cache = FeatureCache(workdir / "cache" / "tiny_qwen3" / "tiny" / "features")  # the prompts it trained on
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
