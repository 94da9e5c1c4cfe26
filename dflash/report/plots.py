"""PNG plots: per-position accuracy curves, tau histograms, metric-against-step curves (for an
evaluation's folder and for the run comparison report)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_styles(n: int) -> list[dict]:
    """A distinct (colour, line style) for each of n lines: the 10 default colours, then again dashed, dotted
    and dash-dotted (a 15-run sweep would otherwise draw runs 1 and 11 alike)."""
    dashes = ["-", "--", ":", "-."]
    return [{"color": f"C{i % 10}", "linestyle": dashes[(i // 10) % len(dashes)]} for i in range(n)]


def line_plot(path: Path, curves: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
              ylim: tuple | None = None, marker: str | None = "o") -> Path:
    """One line per label: curves = {label: (xs, ys)}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, (xs, ys)), style in zip(curves.items(), line_styles(len(curves))):
        ax.plot(xs, ys, marker=marker, label=label, **style)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def acc_curve(summary: dict, key: str = "acc") -> tuple[list, list]:
    """(slots 1..B-1, acc@k) of an evaluation summary (key="unary_acc": a DFlash 2 drafter's argmax path)."""
    B = summary["block_size"]
    return list(range(1, B)), [summary["metrics"].get(f"eval/{key}@{k}", float("nan")) for k in range(1, B)]


def save_plots(out_dir: Path, summaries: dict[str, dict]) -> dict[str, Path]:
    """Per-position accuracy (teacher-forced only) and the tau histogram, one series per summary
    (e.g. a checkpoint and reference drafters)."""
    paths = {}
    if not any(s.get("mode") == "live" for s in summaries.values()):
        curves = {}
        for label, s in summaries.items():
            curves[f"{label} (tau {s['metrics']['eval/tau']:.2f})"] = acc_curve(s)
            if "eval/unary_acc@1" in s["metrics"]:  # DFlash 2: the selector's curve, and its argmax path's
                curves[f"{label} argmax path (tau {s['metrics']['eval/tau_unary']:.2f})"] = acc_curve(s, "unary_acc")
        paths["acc_per_position"] = line_plot(out_dir / "acc_per_position.png", curves, "block slot k",
                                              "accuracy (draft = target token)", "Per-position accuracy", (0, 1.02))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = len(summaries)
    width = 0.8 / max(n, 1)
    for i, (label, s) in enumerate(summaries.items()):
        hist = s["tau_histogram"]
        total = max(sum(hist), 1)
        ax.bar([t + 1 + (i - (n - 1) / 2) * width for t in range(len(hist))], [h / total for h in hist], width,
               label=label)
    ax.set(xlabel="tau (tokens per step)", ylabel="fraction of blocks", title="Acceptance length histogram")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["tau_histogram"] = out_dir / "tau_histogram.png"
    fig.savefig(paths["tau_histogram"], dpi=120)
    plt.close(fig)
    return paths
