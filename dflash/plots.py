"""PNG plots of evaluation summaries: per-position accuracy curves and the tau histogram."""

from __future__ import annotations

from pathlib import Path


def save_plots(out_dir: Path, summaries: dict[str, dict]) -> dict[str, Path]:
    """One curve/bar set per labelled summary (e.g. a checkpoint and reference drafters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    live = any(s.get("mode") == "live" for s in summaries.values())
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in summaries.items():
        B = s["block_size"]
        acc = [s["metrics"].get(f"eval/acc@{k}", float("nan")) for k in range(1, B)]
        tau = s["metrics"].get("eval/tau", s["metrics"].get("eval/live_tau", 0.0))
        ax.plot(range(1, B), acc, marker="o", label=f"{label} (tau {tau:.2f})")
    ax.set(xlabel="block slot k", ylabel="accuracy (draft = target token)", ylim=(0, 1.02),
           title="Per-position accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if not live:
        paths["acc_per_position"] = out_dir / "acc_per_position.png"
        fig.savefig(paths["acc_per_position"], dpi=120)
    plt.close(fig)

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
