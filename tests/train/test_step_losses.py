"""The training step with the other loss members and optimizers: loss=dpace (both normalisations), loss=kl,
tv, nla, expected_tau (online), optim=muon; exact accumulation, exact resume, and the offline refusal of a soft
loss."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash.errors import ConfigError
from dflash.train.loop import train
from dflash.train.step import rescale_gradients
from tests.train.test_loop import assert_resume_reproduces, job_for, metrics


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("losses")


def weights(run):
    return load_file(run / "checkpoints/step-000002/train_state/weights_fp32.safetensors")


def losses(run):
    return [r["train/loss"] for r in metrics(run) if "train/loss" in r]


@pytest.mark.parametrize("member", [
    ("loss=dpace",), ("loss=dpace", "loss.normalize=weights"),
    ("loss=kl", "train.mode=online"), ("loss=kl", "loss.kl_weights=dpace", "train.mode=online"),
    ("loss=tv", "train.mode=online"), ("loss=nla", "loss.kl_weights=dpace", "train.mode=online"),
    ("loss=expected_tau", "loss.temperature=0.7", "train.mode=online"),
    ("optim=muon",)], ids=lambda m: "+".join(m))
def test_two_micro_batches_equal_one_batch_of_both(workdir, member):
    """The step's normaliser (valid anchors, or the D-PACE weight sum known only after the forwards) is the
    whole step's: batch 2 equals batch 1 x grad_accum 2 (the losses logged and the weights). expected_tau's
    normaliser is its blocks with a label: the valid anchors."""
    tag = "-".join(m.split("=")[-1] for m in member)
    common = ("train.max_steps=2", "train.save_every=2", "eval.every=0", *member)
    one = train(job_for(workdir, f"one-{tag}", "train.batch_size=2", *common))
    two = train(job_for(workdir, f"two-{tag}", "train.batch_size=1", "train.grad_accum=2", *common))
    a, b = losses(one), losses(two)
    assert len(a) == 2 and all(torch.isfinite(torch.tensor(a))) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    wa, wb = weights(one), weights(two)
    # Muon orthogonalises in bfloat16 (torch's Newton-Schulz): float32-level gradient differences of another
    # summation order can move an update by a bf16 rounding step of its lr (0.02), not 1e-5
    tol = 2e-3 if "optim=muon" in member else 1e-5
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < tol


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_fused_chunked_ce_trains_as_the_recomputed_chunks(workdir, monkeypatch, kind):
    """loss.fused_ce (the default) reaches the training step: with the loss in chunks (loss.chunk_logits at 3 rows of
    the tiny vocabulary), two steps give the losses and weights of loss.fused_ce=false's recomputed chunks; for
    DFlash 2 with the selector's loss (its own weight and normaliser) from the same chunks."""
    import dflash.drafter.loss as loss_mod

    name = "fused_head_ce" if kind == "dflash" else "fused_head_selector_ce"
    calls, real = [], getattr(loss_mod, name)
    monkeypatch.setattr(loss_mod, name, lambda *a: calls.append(1) or real(*a))
    common = ("train.max_steps=2", "train.save_every=2", "eval.every=0", "loss.chunk_logits=1000",
              f"drafter.kind={kind}", "drafter.selector_rank=8")
    fused = train(job_for(workdir, f"fused-ce-{kind}", *common))
    ran = len(calls)
    recomputed = train(job_for(workdir, f"recomputed-ce-{kind}", *common, "loss.fused_ce=false"))
    assert ran >= 2 and len(calls) == ran  # the training steps' losses went through it, and only with the key on
    # the same sums in another order: float32 rounding of losses near 5.6, whose unit in the last place is 4.8e-7,
    # reached 1.1e-6 on one machine's CPU (2.3 units); a lost or doubled term moves them by 1e-3 or more
    assert max(abs(x - y) for x, y in zip(losses(fused), losses(recomputed))) < 1e-5
    wa, wb = weights(fused), weights(recomputed)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_muon_resume_reproduces_the_uninterrupted_run(workdir, monkeypatch):
    assert_resume_reproduces(workdir, monkeypatch, "muon", ("train.max_steps=6", "train.save_every=3",
                             "train.batch_size=2", "optim=muon", "loss=dpace"), steps=6, cut=3)


@pytest.mark.parametrize("objective", ["kl", "tv", "expected_tau"])
def test_a_soft_loss_on_a_cache_without_logits_is_refused(workdir, objective):
    with pytest.raises(ConfigError, match=f"loss={objective} .*train.mode=online"):
        train(job_for(workdir, f"{objective}-offline", f"loss={objective}", "train.max_steps=1"))


@pytest.mark.parametrize("objective", ["tv", "nla", "expected_tau"])
def test_an_acceptance_loss_trains_online(workdir, objective):
    run = train(job_for(workdir, f"{objective}-online", f"loss={objective}", "train.mode=online",
                        "train.max_steps=2", "train.save_every=1", "train.batch_size=2", "eval.every=0"))
    a = losses(run)
    assert len(a) == 2 and all(torch.isfinite(torch.tensor(a))) and all(x >= 0 for x in a)
    first = load_file(run / "checkpoints/step-000001/train_state/weights_fp32.safetensors")
    assert any(not torch.equal(first[k], w) for k, w in weights(run).items())


def test_weight_normalised_dpace_gradients_are_those_of_the_weight_mean():
    """The backwards ran scaled by 1/anchors; rescaling makes the gradient d(loss_sum / sum of weights)."""
    model = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    loss_sum = model(x).pow(2).sum()
    (loss_sum / 5.0).backward()  # 5 valid anchors
    w = [torch.tensor(2.0), torch.tensor(6.0)]
    acc = SimpleNamespace(num_processes=1)
    total = rescale_gradients(acc, model, torch.tensor(5.0, dtype=torch.float64), w)
    expected = torch.autograd.grad(model(x).pow(2).sum() / 8.0, model.weight)[0]
    assert total.item() == 8.0 and torch.allclose(model.weight.grad, expected)


@pytest.mark.parametrize("objective", ["kl", "expected_tau"])
def test_offline_topk_kl_with_the_whole_vocabulary_equals_online_kl(workdir, objective):
    """A cache extracted with features.topk_logits = vocab (262 for the tiny target) holds the whole
    distribution: offline KL (or expected_tau) trains as online does (float32 features, so the features agree
    too)."""
    common = ("train.max_steps=3", f"loss={objective}", "features.storage=float32", "train.batch_size=2")
    off = train(job_for(workdir, f"{objective}-off", *common, "features.topk_logits=262",
                        f"features.dir={workdir}/cache-top/features"))
    on = train(job_for(workdir, f"{objective}-on", *common, "train.mode=online",
                       f"features.dir={workdir}/cache-top/features"))
    a, b = losses(off), losses(on)
    assert len(a) == 3 and all(abs(x - y) < 1e-4 for x, y in zip(a, b)), (a, b)


def test_a_cache_with_another_k_is_refused_for_kl(workdir):
    train(job_for(workdir, "kl16-make", "train.max_steps=1", "loss=kl", "features.topk_logits=16",
                  f"features.dir={workdir}/cache-top16/features"))
    with pytest.raises(ConfigError, match="features.topk_logits=8, but the feature cache .* stores the top 16"):
        train(job_for(workdir, "kl8", "train.max_steps=1", "loss=kl", "features.topk_logits=8",
                      f"features.dir={workdir}/cache-top16/features"))


def test_offline_topk_kl_accumulates_exactly(workdir):
    common = ("train.max_steps=2", "train.save_every=2", "loss=kl", "features.topk_logits=16",
              f"features.dir={workdir}/cache-top16/features")
    one = train(job_for(workdir, "kl16-one", "train.batch_size=2", *common))
    two = train(job_for(workdir, "kl16-two", "train.batch_size=1", "train.grad_accum=2", *common))
    a, b = losses(one), losses(two)
    assert len(a) == 2 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    wa, wb = weights(one), weights(two)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("member", [("loss=dpace", "loss.normalize=weights"), ("loss=dpace",)],
                         ids=["dpace-weights", "dpace-anchor"])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, tiny_targets, member):
    """The D-PACE normalisers are the whole step's over processes: the weight sum all_reduced after the
    forwards (rescale_gradients), the valid anchors before them."""
    from tests.train.test_distributed import two_processes_match_one

    two_processes_match_one(tmp_path, *member)
