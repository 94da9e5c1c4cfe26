"""The acceptance-loss comparison table (docs/results/2026-12-03-sampling.md) from the runs of sweeps/acceptance.sh.

    python sweeps/acceptance_table.py runs/acceptance [runs/dflash2=decay_ce]   # extra roots: root=arm

Per arm (dflash.report's arms: configs that differ in train.seed only; named by the run name before -s<seed>): the
greedy walk tau of the final in-run evaluation (greedy held-out set) and the expected walk tau at temperature 1
(evaluate.py eval.decode.temperature=1.0: eval/step-000768-t1, or an older sampled evaluation in eval/step-000768), mean
and sample sd over seeds, and the seeds it has.
"""

import json
import statistics
import sys
from pathlib import Path

from dflash.report.compare import seeds_by_arm


def final(run: Path) -> tuple[float | None, float | None]:
    greedy = sampled = None
    for d in sorted(run.glob("eval/step-000768*")):
        m = json.loads((d / "summary.json").read_text())["metrics"]
        if "eval/tau_expected" in m:
            sampled = m["eval/tau_expected"]
        elif d.name.startswith("step-000768") and "live" not in d.name and "eval/tau" in m and greedy is None:
            greedy = m["eval/tau"]
    return greedy, sampled


def main(args: list[str]) -> None:
    arms: dict[str, list[tuple[int, float | None, float | None]]] = {}
    for spec in args:
        root, _, rename = spec.partition("=")
        # dflash.report's arms (configs that differ in seed only), of the runs with evaluations
        found = seeds_by_arm(sorted(Path(root).iterdir()),
                             lambda run: final(run["path"]) if (run["path"] / "eval").exists() else None)
        for name, seeds in found.items():
            if rename and name != "dflash":
                continue
            arms[rename or name] = [(seed, *taus) for seed, taus in seeds.items()]
    print("| arm | seeds | walk tau, greedy | sd | expected walk tau, T = 1 | sd |")
    print("|---|---|---|---|---|---|")
    for arm, rows in arms.items():
        cells = []
        for col in (1, 2):
            vals = [r[col] for r in rows if r[col] is not None]
            mean = f"{statistics.mean(vals):.3f}" if vals else "-"
            sd = f"{statistics.stdev(vals):.3f}" if len(vals) > 1 else "-"
            cells += [mean, sd]
        print(f"| {arm} | {','.join(str(r[0]) for r in rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
