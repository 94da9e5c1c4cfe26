"""Live evaluation on every target kind: the chain and each DDTree budget, lossless, one forward a block."""

import io

import pytest
import torch

from dflash.config import DrafterConfig, LayersConfig
from dflash.drafter.build import build_drafter
from dflash.evaluate.live import live_eval
from dflash.evaluate.summary import print_summary
from tests.conftest import compose


@pytest.mark.parametrize("target_name", ["tiny_qwen3_5", "tiny_qwen3_sliding"])
def test_live_trees_on_hybrid_and_sliding_targets(tiny_targets, target_name):
    job = compose("evaluate", ["debug=tiny", f"target={target_name}", "eval=live", "eval.ddtree_budgets=[4,16]",
                               "eval.max_new_tokens=24"])
    target = tiny_targets[target_name]
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4), LayersConfig(num=2), target).eval()
    records, summary = live_eval(job, drafter, target)
    m = summary["metrics"]
    assert summary["tree_verification"] == ("paths" if target.is_hybrid else "sequence")
    assert m["eval/live_ties"] == 0 and m["eval/live_tokens"] == 2 * 24
    for prefix in ("eval/live_", "eval/live_ddtree@4_", "eval/live_ddtree@16_"):
        blocks = m["eval/live_tokens"] / m[f"{prefix}tokens_per_verify"]
        # one target forward per block and the prompt's (2 prompts): no replay on the hybrid target
        assert m[f"{prefix}tokens_per_forward"] == pytest.approx(m["eval/live_tokens"] / (blocks + 2))
    assert m["eval/live_verify_cost"] <= 4  # 1 + at most B-1 drafts
    assert m["eval/live_ddtree@16_verify_cost"] > m["eval/live_ddtree@4_verify_cost"] > 1
    assert {r["tree_budget"] for r in records} == {None, 4, 16}
    out = io.StringIO()
    print_summary({"random": summary}, mode="live", out=out)
    assert "cost/verify" in out.getvalue() and "ddtree@16" in out.getvalue()


class _Clock:
    """A perf_counter that stands still but for the cold start it is told of: timings from it are exact."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_first_forwards_cold_start_is_not_timed(tiny_targets, monkeypatch):
    """The first forward of a process pays the kernels' compiles and autotuning (fla's: 45 s on an H200 for a
    hybrid target); simulated here as 100 s on a clock that otherwise stands still. With the warm-up (the default)
    no timed decoding counts it and the taus are those of a run without it; eval.warmup_tokens=0 times it as the
    plain decoding's (that decoding runs first), which made live speedups of a short evaluation meaningless."""
    import dflash.evaluate.live as live

    target = tiny_targets["tiny_qwen3_5"]
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4), LayersConfig(num=2), target).eval()
    results = {}
    for warmup in (32, 0):
        clock = _Clock()
        monkeypatch.setattr(live, "time", clock)
        cold = [True]

        def first_forward(_module, _args, clock=clock, cold=cold):
            if cold[0]:
                clock.now += 100.0
                cold[0] = False

        hook = target.layers[0].register_forward_pre_hook(first_forward)
        try:
            job = compose("evaluate", ["debug=tiny", "target=tiny_qwen3_5", "eval=live", "eval.ddtree_budgets=[4]",
                                       "eval.max_new_tokens=12", f"eval.warmup_tokens={warmup}"])
            results[warmup] = live_eval(job, drafter, target)[1]["metrics"]
        finally:
            hook.remove()
    warm, cold_run = results[32], results[0]
    assert warm["eval/live_plain_s"] == 0 and warm["eval/live_spec_s"] == 0 and warm["eval/live_ddtree@4_spec_s"] == 0
    assert cold_run["eval/live_plain_s"] == 100
    for key in ("eval/live_tau", "eval/live_ddtree@4_tau", "eval/live_tokens"):
        assert warm[key] == cold_run[key]
