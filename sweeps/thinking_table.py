"""The thinking sweep's table (docs/results/2026-12-05-thinking.md) from the runs of sweeps/thinking.sh.

    python sweeps/thinking_table.py runs/thinking

Per arm (dflash.report's arms: configs that differ in train.seed only; named by the run name before -s<seed>),
mean and sample sd over seeds of the evaluation sweeps/thinking.sh ran
after training (the 64 held-out renames rendered with thinking on and off, greedy, teacher-forced: the decoding
walk), read from the newest summary.json of the run's last step that has both thinking slices: its in-run
evaluation's folder for the mix arm, beside it for the others (evaluate.py at their other data.sources:
eval/step-000768-sources-<digest>, dflash.evaluate.settings); tau per slice (tokens over blocks), the same as a mean
over prompts (tau_macro), and the whole set's tau; then each seed's slice taus.
"""

import json
import statistics
import sys
from pathlib import Path

from dflash.layout import RunLayout
from dflash.report.compare import seeds_by_arm

SLICES = ("on", "off")


def summary_of(run: Path) -> dict | None:
    """The evaluation sweeps/thinking.sh ran after training (the last step's, with both thinking slices), or None
    while the run is unfinished (no checkpoints/best.json: its step-0 evaluation may already have both slices)."""
    if not (run / "checkpoints" / "best.json").exists():
        return None
    steps = RunLayout(run).step_evaluations()
    if not steps:
        return None
    last = steps[-1][1].parent  # eval/step-000768: evaluate.py at other settings writes step-000768-<tag> beside it
    found = []
    for path in sorted(last.parent.glob(f"{last.name}*/summary.json"), key=lambda p: p.stat().st_mtime):
        summary = json.loads(path.read_text())
        metrics = summary.get("metrics", {})
        if summary.get("mode") == "teacher_forced" and all(f"eval/slice/thinking/{s}/tau" in metrics for s in SLICES):
            found.append(metrics)
    return found[-1] if found else None


def row(metrics: dict) -> dict:
    out = {}
    for s in SLICES:
        out[f"tau {s}"] = metrics[f"eval/slice/thinking/{s}/tau"]
        out[f"tau_macro {s}"] = metrics[f"eval/slice/thinking/{s}/tau_macro"]
    out["tau all"] = metrics["eval/tau"]
    out["blocks on/off"] = (metrics["eval/slice/thinking/on/blocks"], metrics["eval/slice/thinking/off/blocks"])
    return out


def cell(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" + (f" ({statistics.stdev(values):.3f})" if len(values) > 1 else "")


def main(root: str) -> None:
    # dflash.report's arms (configs that differ in seed only), of the finished runs
    arms = seeds_by_arm(sorted(Path(root).iterdir()),
                        lambda run: row(metrics) if (metrics := summary_of(run["path"])) else None)
    columns = ("tau on", "tau off", "tau_macro on", "tau_macro off", "tau all")
    print("| arm | seeds | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for arm, seeds in arms.items():
        print(f"| {arm} | {len(seeds)} | " + " | ".join(cell([r[c] for r in seeds.values()]) for c in columns) + " |")
    print("\n| run | tau on | tau off | blocks on / off |\n|---|---|---|---|")
    for arm, seeds in arms.items():
        for seed, r in sorted(seeds.items()):
            print(f"| {arm}-s{seed} | {r['tau on']:.3f} | {r['tau off']:.3f} | {r['blocks on/off'][0]} / "
                  f"{r['blocks on/off'][1]} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/thinking")
