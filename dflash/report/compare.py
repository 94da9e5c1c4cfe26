"""Compare runs without the W&B UI: a table, PNG plots and one Markdown/HTML page.

    python -m dflash.report runs=[run_a,run_b]            # names under runs/ or paths
    python -m dflash.report runs=all root=runs out=reports/lr-sweep
    python -m dflash.report runs=[multirun/20261129-101500] # every run of a sweep (by group)

Reads each run folder's metrics.jsonl, config.yaml and eval/*/summary.json. The table holds
final and best held-out tau, acc@1, ddtree@8 and train loss per run, with the config keys that
differ between the runs as columns; where runs repeat an arm with other seeds (train.seed), a second table
gives each arm's mean and spread over its seeds.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path

from dflash.config import ReportConfig
from dflash.errors import NotFoundError
from dflash.io import write_json
from dflash.layout import RunLayout
from dflash.report.plots import acc_curve, line_plot
from dflash.tracking import read_metrics


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_run(path: Path) -> dict:
    """Metrics, config and teacher-forced eval summaries (by step) of one run folder."""
    run = RunLayout(path)
    if not run.metrics.exists():
        raise NotFoundError(f"{path} has no metrics.jsonl: not a dflash run folder")
    config = run.trained_config()
    evals = {}
    for _, s in run.step_evaluations():  # not evaluate.py's at other settings (step-000768-t1): not the run's curve
        summary = json.loads(s.read_text())
        if summary.get("mode", "teacher_forced") == "teacher_forced" and summary.get("step") is not None:
            evals[summary["step"]] = summary
    info = json.loads(run.info.read_text()) if run.info.exists() else {}
    return {"name": run.name, "path": path, "metrics": read_metrics(run), "config": _flatten(config),
            "evals": evals, "info": info}


def _has_metrics(path: Path) -> bool:
    return RunLayout(path).metrics.exists()


def resolve_runs(spec: list[str], root: Path) -> list[Path]:
    if spec == ["all"]:
        return sorted(p for p in root.iterdir() if _has_metrics(p))
    paths = []
    for item in spec:
        p = Path(item) if Path(item).exists() else root / item
        if not p.exists():
            raise NotFoundError(f"no run {item!r} (looked for {item} and {root / item})")
        if _has_metrics(p):
            paths.append(p)
        else:  # a sweep folder: the runs whose W&B group or name is this sweep's
            group = p.name
            paths += sorted(r for r in root.iterdir() if _has_metrics(r) and (
                json.loads(RunLayout(r).info.read_text()).get("wandb_group") == group or r.name.startswith(group)))
    if not paths:
        raise NotFoundError(f"no runs matched {spec} under {root}")
    return paths


def differing_keys(runs: list[dict]) -> list[str]:
    ignore = ("run.", "logger.", "train.resume", "features.dir", "data.completions.path")
    keys = set().union(*(r["config"] for r in runs))
    return sorted(k for k in keys if not k.startswith(ignore) and len({json.dumps(r["config"].get(k)) for r in runs}) > 1)


def summary_row(run: dict) -> dict:
    evals = run["evals"]
    steps = sorted(evals)
    best = max(steps, key=lambda s: evals[s]["metrics"]["eval/tau"]) if steps else None
    pick = lambda s, k: evals[s]["metrics"].get(k) if s is not None else None  # noqa: E731
    losses = [m["train/loss"] for m in run["metrics"] if "train/loss" in m]
    return {"run": run["name"], "final_step": steps[-1] if steps else None,
            "final_tau": pick(steps[-1] if steps else None, "eval/tau"), "best_tau": pick(best, "eval/tau"),
            "best_step": best, "acc@1": pick(best, "eval/acc@1"), "ddtree@8": pick(best, "eval/ddtree@8"),
            "final_loss": losses[-1] if losses else None}


SEED_KEYS = ("train.seed",)
"""Config keys that make repeats of one arm (a sweep's seeds), not different arms."""


def arms_of(runs: list[dict], keys: list[str]) -> tuple[list[str], dict[str, list[dict]]]:
    """Runs grouped by arm: their values of the differing `keys` other than the seeds (SEED_KEYS). Returns (the arm
    keys, {arm label ("k=v k=v", or "all"): its runs}, in first-seen order). The report's arm table and the sweeps'
    tables (sweeps/*_table.py) group with it."""
    arm_keys = [k for k in keys if k not in SEED_KEYS]
    groups: dict[str, list[dict]] = {}
    for r in runs:
        arm = " ".join(f"{k}={_fmt(r['config'].get(k))}" for k in arm_keys) or "all"
        groups.setdefault(arm, []).append(r)
    return arm_keys, groups


def named_arms(runs: list[dict]) -> dict[str, list[dict]]:
    """`arms_of` over the runs' differing keys, each arm named as a sweep names its runs: their shared name less
    -s<train.seed> (sweeps/*.sh run <arm>-s<seed>), else the config label. What the sweeps' tables group by."""
    named = {}
    for label, members in arms_of(runs, differing_keys(runs))[1].items():
        stems = {r["name"].removesuffix(f"-s{r['config'].get('train.seed')}") for r in members}
        named[stems.pop() if len(stems) == 1 else label] = members
    return named


def seeds_by_arm(folders: list[Path], read: Callable[[dict], object]) -> dict[str, dict[int, object]]:
    """{arm (`named_arms`): {train.seed: read(run)}} over the run folders among `folders` (those with metrics.jsonl,
    each loaded by `load_run`) where read(run) is not None: a run without what a table reads (unfinished) is left
    out before the arms are formed, so it does not change which keys differ. The sweeps' tables read with it."""
    kept, values = [], {}
    for path in folders:
        if not _has_metrics(path):
            continue
        run = load_run(path)
        value = read(run)
        if value is not None:
            kept.append(run)
            values[path] = value
    return {name: {r["config"].get("train.seed"): values[r["path"]] for r in members}
            for name, members in named_arms(kept).items()}


def arm_rows(runs: list[dict], keys: list[str]) -> tuple[list[str], list[dict]]:
    """Runs grouped by arm (`arms_of`), with the mean and spread (sample standard deviation, n-1) over each arm's
    seeds of the final held-out tau, acc@1 and ddtree@8 and the best tau. Returns (the arm keys, one row per arm, in
    first-seen order); no rows when no arm has two runs (nothing to average)."""
    arm_keys, groups = arms_of(runs, keys)
    if all(len(g) < 2 for g in groups.values()):
        return arm_keys, []
    rows = []
    # DFlash 2 runs also have their argmax path's and their selector ceiling's tau (dflash.evaluate.walk)
    extra = [(n, f"eval/{n}") for n in ("tau_unary", "tau_oracle")
             if any(_final(r, f"eval/{n}") is not None for r in runs)]
    for arm, members in groups.items():
        row = {"arm": arm, "seeds": len(members)}
        for name, key in (("tau", "eval/tau"), ("acc@1", "eval/acc@1"), ("ddtree@8", "eval/ddtree@8"), *extra):
            row[name], row[f"{name} sd"] = _mean_sd([_final(m, key) for m in members])
        row["best_tau"], row["best_tau sd"] = _mean_sd([summary_row(m)["best_tau"] for m in members])
        rows.append(row)
    return arm_keys, rows


def _final(run: dict, key: str):
    evals = run["evals"]
    return evals[max(evals)]["metrics"].get(key) if evals else None


def _mean_sd(values: list) -> tuple[float | None, float | None]:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    if not xs:
        return None, None
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else None
    return mean, sd


def curve(metrics: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of `key` in step order, the last value logged at a step kept: evaluate.py logs an earlier
    checkpoint after later ones (a line drawn in logging order went back and forth)."""
    at = {m["step"]: m[key] for m in metrics if isinstance(m.get(key), (int, float))}
    steps = sorted(at)
    return steps, [at[s] for s in steps]


def make_plots(runs: list[dict], out: Path) -> dict[str, Path]:
    """held-out tau, train loss and train tau against step (all runs), and per-position accuracy
    at each run's best checkpoint."""
    plots = {}
    for key, title, marker in (("eval/tau", "held-out tau", "o"), ("train/loss", "train loss", None),
                               ("train/tau", "train tau", None)):
        curves = {r["name"]: pts for r in runs if (pts := curve(r["metrics"], key))[0]}
        name = key.replace("/", "_")
        plots[name] = line_plot(out / f"{name}.png", curves, "train step", key, title, marker=marker)
    best = {r["name"]: summary_row(r)["best_step"] for r in runs}
    curves = {f"{r['name']} (step {best[r['name']]})": acc_curve(r["evals"][best[r["name"]]])
              for r in runs if best[r["name"]] is not None}
    plots["acc_per_position"] = line_plot(out / "acc_per_position.png", curves, "block slot k", "accuracy",
                                          "per-position accuracy at best checkpoint", (0, 1.02))
    return plots


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_report(paths: list[Path], out: Path) -> Path:
    """report.md + report.html + PNGs in `out`; returns the Markdown page."""
    runs = [load_run(p) for p in paths]
    out.mkdir(parents=True, exist_ok=True)
    keys = differing_keys(runs)
    rows = [summary_row(r) for r in runs]
    header = list(rows[0]) + keys
    table = [[_fmt(row[h]) for h in rows[0]] + [_fmt(r["config"].get(k)) for k in keys] for row, r in zip(rows, runs)]
    plots = make_plots(runs, out)
    md = ["# dflash run comparison", "", f"{len(runs)} runs: " + ", ".join(f"`{r['path']}`" for r in runs), "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in table]
    arm_keys, arms = arm_rows(runs, keys)
    if arms:
        cols = list(arms[0])
        md += ["", f"## Per arm: mean and sample sd over seeds (final held-out eval; arms by {', '.join(arm_keys)})",
               "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(_fmt(a[c]) for c in cols) + " |" for a in arms]
    md += ["", *[f"![{name}]({p.name})" for name, p in plots.items()], ""]
    page = out / "report.md"
    page.write_text("\n".join(md))
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table)
    (out / "report.html").write_text(
        "<!doctype html><meta charset=utf-8><title>dflash runs</title><h1>dflash run comparison</h1><table border=1>"
        "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + f"</tr>{cells}</table>"
        + "".join(f'<h3>{n}</h3><img src="{p.name}">' for n, p in plots.items()))
    write_json(out / "summary.json", {"rows": rows, "arms": arms,
                                      "differing": {k: {r["name"]: r["config"].get(k) for r in runs} for k in keys}})
    return page


def report(cfg: ReportConfig) -> Path:
    """`python -m dflash.report`: write the comparison of cfg.runs and print its table; returns report.md."""
    root = Path(cfg.root)
    paths = resolve_runs(list(cfg.runs), root)
    out = Path(cfg.out) if cfg.out else root / "reports" / "-".join(p.name for p in paths)[:100]
    page = write_report(paths, out)
    print(page.read_text().split("\n\n![")[0])
    print(f"\nreport: {page} (and report.html, PNGs) in {out}")
    return page
