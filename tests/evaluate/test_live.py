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
