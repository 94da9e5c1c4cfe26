"""The selector sweep's table (docs/results/2026-12-03-dflash2.md) from the runs of sweeps/selector.sh.

    python sweeps/selector_table.py runs/selector [reference arm, default dflash]

Per arm (dflash.report's arms: runs whose configs differ only in train.seed; named by the run name before
-s<seed>), mean and sample sd over seeds, from each run's final in-run evaluation
(the 64 held-out prompts, greedy; eval/step-<last>/summary.json) and its last 11 log windows (the last 100 steps):
walk tau, every-anchor tau, tau_unary, tau_oracle (the oracle gap is oracle - walk), the served-semantics strict
selector accuracy at slot 1 (eval/acc@1) and train/tau, train/topk_recall; then, prompt by prompt against the
reference arm of the same seed (each prompt's walk tau), the prompts it wins and the ones it loses by more than 0.5,
and its worst loss. The s/step column is the median step time of the windows (valid only for runs made alone).
"""

import json
import statistics
import sys
from pathlib import Path

from dflash.layout import RunLayout
from dflash.report.compare import seeds_by_arm

COLUMNS = ("walk tau", "every-anchor tau", "tau_unary", "tau_oracle", "oracle gap", "acc@1", "train/tau",
           "train/topk_recall", "s/step")


def run_row(run: dict, final: Path) -> tuple[dict, dict]:
    """(the columns, {prompt: walk tau}) of one run (dflash.report's load_run: its metrics and flattened config)
    whose last evaluation's summary.json is `final`."""
    summary = json.loads(final.read_text())
    m = summary["metrics"]
    windows = [w for w in run["metrics"] if "train/tau" in w]
    last = [w for w in windows if w["step"] >= windows[-1]["step"] - 100] if windows else []
    mean = lambda key: statistics.mean(w[key] for w in last) if last and key in last[0] else None  # noqa: E731
    rate = statistics.median(w["train/anchors_per_s"] for w in windows) if windows else None
    c = run["config"]
    per_step = c["train.batch_size"] * c["train.num_anchors"] * c["train.grad_accum"]
    row = {"walk tau": m["eval/tau"], "every-anchor tau": m.get("eval/tau_all_anchors"),
           "tau_unary": m.get("eval/tau_unary"), "tau_oracle": m.get("eval/tau_oracle"),
           "oracle gap": (m["eval/tau_oracle"] - m["eval/tau"]) if "eval/tau_oracle" in m else None,
           "acc@1": m.get("eval/acc@1"), "train/tau": mean("train/tau"), "train/topk_recall": mean("train/topk_recall"),
           "s/step": (per_step / rate) if rate else None}
    return row, {pid: t["tau"] for pid, t in summary["per_prompt"].items() if "tau" in t}


def final_eval(run: Path) -> Path | None:
    """The summary.json of the run's last in-run evaluation (eval/step-<largest>; the one at step 0 does not count,
    nor those of later evaluate.py calls at other settings, e.g. step-000768-t1), or None."""
    steps = [p for step, p in RunLayout(run).step_evaluations() if step > 0]
    return steps[-1] if steps else None


def main(root: str, reference: str = "dflash") -> None:
    # dflash.report's arms (configs that differ in seed only), of the runs with a last evaluation
    arms = seeds_by_arm(sorted(Path(root).iterdir()),
                        lambda run: run_row(run, final) if (final := final_eval(run["path"])) else None)
    print("| arm | seeds | " + " | ".join(COLUMNS) + f" | prompts won / lost by > 0.5 vs {reference} | worst |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 2))
    for arm, seeds in arms.items():
        cells = []
        for col in COLUMNS:
            vals = [row[col] for row, _ in seeds.values() if row[col] is not None]
            cells.append("" if not vals else f"{statistics.mean(vals):.3f}" + (
                f" ({statistics.stdev(vals):.3f})" if len(vals) > 1 else ""))
        versus, worst = "", ""
        if arm != reference and reference in arms:
            won = lost = 0
            low = 0.0
            for seed, (_, prompts) in seeds.items():
                if seed not in arms[reference]:
                    continue
                base = arms[reference][seed][1]
                diffs = [prompts[p] - base[p] for p in prompts if p in base]
                won += sum(d > 0 for d in diffs)
                lost += sum(d < -0.5 for d in diffs)
                low = min([low, *diffs])
            versus, worst = f"{won} / {lost}", f"{low:+.2f}"
        print(f"| {arm} | {','.join(map(str, sorted(seeds)))} | " + " | ".join(cells) + f" | {versus} | {worst} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
