"""dflash.evaluate.serving: live evaluation's summary carries the serving model's speedup per concurrency, the one
`python -m dflash.plan ... concurrency=... tau=<that summary>` prints for the same drafter."""

import io
import json

import pytest
import torch

from dflash.drafter.build import build_drafter
from dflash.errors import ConfigError
from dflash.evaluate.live import live_eval
from dflash.plan.report import main
from dflash.report.summary import print_summary
from tests.conftest import compose

SHAPE = ["target=tiny_qwen3", "drafter.num_layers=2", "drafter.block_size=4", "layers.num=2"]


def test_live_summary_predicts_the_plans_speedup_at_each_concurrency(tiny_targets, tmp_path, capsys):
    job = compose("evaluate", [*SHAPE, "eval=live", "eval.max_prompts=2", "eval.max_new_tokens=24",
                               "eval.ddtree_budgets=[]", "eval.serving.concurrency=[1,8,32]", "eval.serving.gpu=h100"])
    target = tiny_targets["tiny_qwen3"]
    torch.manual_seed(0)
    drafter = build_drafter(job.drafter, job.layers, target).eval()
    _, summary = live_eval(job.eval, job.data, drafter, target)
    m, served = summary["metrics"], summary["serving"]
    assert served["tau"] == pytest.approx(m["eval/live_tau"]) and served["gpu"] == "H100 SXM"
    assert served["output_tokens"] == pytest.approx(m["eval/live_tokens"] / m["eval/live_requests"])
    assert [m[f"eval/live_serving@{c}_speedup"] for c in (1, 8, 32)] == list(served["speedup"].values())
    # the plan, from the config alone (a meta drafter, the target's config), with tau read from the summary
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    main([*SHAPE, "concurrency=[1,8,32]", "gpu=h100", f"tau={tmp_path / 'summary.json'}",
          f"context={served['context']}", f"output_tokens={served['output_tokens']}", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert planned["tau_where"].startswith("eval/live_tau of")
    for c in (1, 8, 32):
        assert served["speedup"][c] == pytest.approx(planned["speedup"][str(c)], rel=1e-9)
    out = io.StringIO()
    print_summary({"random": summary}, mode="live", out=out)
    assert "predicted for one H100 SXM by the serving cost model (not measured)" in out.getvalue()
    assert "at C = 32" in out.getvalue() and served["predicted"] is True


def test_no_concurrency_no_prediction_and_an_unknown_gpu_is_refused(tiny_targets):
    job = compose("evaluate", [*SHAPE, "eval=live", "eval.max_prompts=1", "eval.max_new_tokens=8",
                               "eval.ddtree_budgets=[]", "eval.serving.concurrency=[]"])
    target = tiny_targets["tiny_qwen3"]
    drafter = build_drafter(job.drafter, job.layers, target).eval()
    _, summary = live_eval(job.eval, job.data, drafter, target)
    assert "serving" not in summary and not any("serving" in k for k in summary["metrics"])
    with pytest.raises(ConfigError, match="eval.serving.gpu"):
        compose("evaluate", ["eval.serving.gpu=tpu"])
    with pytest.raises(ConfigError, match=r"eval.serving.concurrency\[\*\]"):
        compose("evaluate", ["eval.serving.concurrency=[0]"])
