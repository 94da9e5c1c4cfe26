"""Evaluation results into W&B and onto the terminal."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dflash.io import read_json
from dflash.tracking import read_metrics


def log_eval(logger, summary: dict, step: int, images: dict[str, Path] | None = None) -> None:
    """eval/* scalars at the checkpoint's training step; per-position accuracy as a table (plots
    as a curve per run), the tau histogram and the plots as images."""
    logger.log(summary["metrics"], step)
    if logger.wandb is None or summary.get("mode") in ("live", "other_settings"):  # eval/<tag>/*: runner.tagged
        return
    logger.summary(best_summary(logger.run, summary["metrics"]["eval/tau"], step))
    import wandb  # here: wandb takes seconds to import, and only a logged run needs it

    B = summary["block_size"]
    acc = wandb.Table(columns=["slot", "acc", "step"],
                      data=[[k, summary["metrics"][f"eval/acc@{k}"], step] for k in range(1, B)])
    hist = wandb.Table(columns=["tau", "blocks"], data=[[t + 1, c] for t, c in enumerate(summary["tau_histogram"])])
    media = {
        "eval/acc_per_position": wandb.plot.line(acc, "slot", "acc", title=f"per-position accuracy (step {step})"),
        "eval/tau_hist": wandb.plot.bar(hist, "tau", "blocks", title=f"tau histogram (step {step})"),
    }
    media.update({f"eval/{name}": wandb.Image(str(path)) for name, path in (images or {}).items()})
    logger.log_media(media, step)


def best_summary(run, tau: float, step: int) -> dict:
    """The run's best held-out tau for W&B's summary: the run folder's record (best.json) or this evaluation's,
    whichever is higher. Not W&B's summary="max", which each process computes over its own history: an
    evaluate.py of an older, worse checkpoint (offline, synced after the training) would end on its value."""
    best = read_json(run.best) if run.best.exists() else None
    if best is not None and best.get("tau") is not None and best["tau"] >= tau:
        tau, step = best["tau"], best["step"]
    return {"eval/tau": tau, "eval/best_step": step}


def train_gap(run, step: int, metrics: dict) -> dict:
    """Training's metrics next to held-out ones, in the same units: the train window (train/tau, train/acc@1: means
    over randomly sampled anchors) logged nearest `step` against the held-out every-anchor mean (the same
    estimator), and their ratios (`eval/gap_tau`, `eval/gap_acc@1`: held-out over train). {} without train metrics
    (step 0, a foreign drafter)."""

    rows = [r for r in read_metrics(run) if "train/tau" in r] if run is not None else []
    if not rows or "eval/tau_all_anchors" not in metrics:
        return {}
    near = min(rows, key=lambda r: (abs(r["step"] - step), -r["step"]))
    out = {"eval/train_step": near["step"], "eval/train_tau": near["train/tau"],
           "eval/train_acc@1": near["train/acc@1"],
           "eval/gap_tau": metrics["eval/tau_all_anchors"] / near["train/tau"]}
    if near["train/acc@1"] > 0:
        out["eval/gap_acc@1"] = metrics["eval/acc@1"] / near["train/acc@1"]
    return out


def print_gap(label: str, m: dict, out=None) -> None:
    """One line: the train window's tau and acc@1 beside the held-out ones (every anchor, then the walk)."""
    if "eval/gap_tau" not in m:
        return
    acc = f", acc@1 {m['eval/acc@1']:.3f} vs {m['eval/train_acc@1']:.3f}" + (
        f" ({m['eval/gap_acc@1']:.0%})" if "eval/gap_acc@1" in m else "")
    (out or sys.stdout).write(
        f"{label}: held-out every-anchor tau {m['eval/tau_all_anchors']:.3f} vs train {m['eval/train_tau']:.3f} "
        f"(window at step {m['eval/train_step']}: {m['eval/gap_tau']:.0%}){acc}; decoding-walk tau {m['eval/tau']:.3f}\n")


def print_summary(summaries: dict[str, dict], mode: str = "teacher_forced", out=None) -> None:
    """One row per drafter. Teacher-forced: tau over the decoding walk (micro, macro), the walk's share of
    blocks accepted in full, tau over every anchor (tau_all), acc@1, acc@B/2, acc@B-1 (every anchor),
    ddtree@N over its own walk, the walk's blocks. Live, a row per verifier (the chain, each DDTree budget):
    real tau, tokens per target forward and per verification, tokens a verification processes (its cost),
    wall-clock speedup over plain decoding; then what was measured on this machine (`print_timing`, `print_measured`)
    before the serving model's prediction for a GPU (`print_serving`), labelled as one."""
    first = next(iter(summaries.values()))
    B, budgets = first["block_size"], first["ddtree_budgets"]
    # DFlash 2 (any drafter with the selector's numbers): its unary and oracle taus and pairwise trees beside
    dflash2 = any("eval/tau_unary" in s["metrics"] or "eval/live_ddtree_pair@" in " ".join(s["metrics"])
                  for s in summaries.values())
    # sampled (eval.decode.temperature > 0): the expected acceptance teacher-forced, the standard errors over prompts
    sampled = any("eval/tau_expected" in s["metrics"] for s in summaries.values())
    if mode == "live":
        header = ["drafter", "verify", "tau", "tau_se", "tok/forward", "tok/verify", "cost/verify", "speedup",
                  "tokens"]
        verifiers = live_verifiers(budgets, dflash2)
        rows = [[label, name, m[f"{prefix}tau"], m.get(f"{prefix}tau_se", "-"), m[f"{prefix}tokens_per_forward"],
                 m[f"{prefix}tokens_per_verify"], m[f"{prefix}verify_cost"], m[f"{prefix}speedup"],
                 m["eval/live_tokens"]]
                for label, m in ((k, s["metrics"]) for k, s in summaries.items())
                for name, prefix in verifiers if f"{prefix}tau" in m]
    else:
        mid = max(1, (B - 1) // 2)
        pair = [f"ddtree_pair@{n}" for n in budgets] if dflash2 else []
        expected = ["tau_expected", "tau_expected_se", "tau_alpha_product", "alpha@1"] if sampled else []
        header = ["drafter", "tau", "tau_macro", "full", "tau_all", "acc@1", f"acc@{mid}", f"acc@{B - 1}",
                  *[f"ddtree@{n}" for n in budgets], *(["tau_unary", "tau_oracle", *pair] if dflash2 else []),
                  *expected, "blocks"]
        rows = [[label, m["eval/tau"], m["eval/tau_macro"], m["eval/full"], m["eval/tau_all_anchors"],
                 m["eval/acc@1"], m.get(f"eval/acc@{mid}", 0.0), m.get(f"eval/acc@{B - 1}", 0.0),
                 *[m[f"eval/ddtree@{n}"] for n in budgets],
                 *[m.get(f"eval/{k}", "-") for k in (["tau_unary", "tau_oracle", *pair] if dflash2 else [])],
                 *[m.get(f"eval/{k}", "-") for k in expected], m["eval/blocks"]]
                for label, m in ((k, s["metrics"]) for k, s in summaries.items())]
    print_table(rows, header, out)
    if mode != "live":
        for label, summary in summaries.items():
            print_gap(label, summary["metrics"], out)
    else:
        # the measured figures first, the model's prediction for a GPU after them and named as one
        print_timing(summaries, live_verifiers(budgets, dflash2), out)
        for label, summary in summaries.items():
            print_measured(label, summary, live_verifiers(budgets, dflash2), out)
            print_serving(label, summary.get("serving"), out)
    print_slices(summaries, out)


def live_verifiers(budgets: list[int], dflash2: bool) -> list[tuple[str, str]]:
    """(name, metric prefix) of live decoding's verifiers: the chain, each DDTree budget, DFlash 2's beam chain and
    pairwise trees (dflash.evaluate.live)."""
    return [("chain", "eval/live_"), *[(f"ddtree@{n}", f"eval/live_ddtree@{n}_") for n in budgets],
            ("beam", "eval/live_beam_"),
            *[(f"ddtree_pair@{n}", f"eval/live_ddtree_pair@{n}_") for n in budgets if dflash2]]


def _device(summary: dict) -> str:
    return (summary.get("measured_on") or {}).get("name", "this machine")


def print_timing(summaries: dict[str, dict], verifiers: list[tuple[str, str]], out=None) -> None:
    """The wall-clock table of a live evaluation, a row per drafter and verifier: tokens a second plainly and
    speculatively, their ratio, tau, the drafter's and the verification's (and the rest's) milliseconds per block,
    plain decoding's per token, and a verification's time in plain steps (verify/plain). Nothing for summaries
    written before the timings were split."""
    rows = [[label, name, f"{m['eval/live_plain_tokens_per_s']:.1f}", f"{m[f'{prefix}tokens_per_s']:.1f}",
             f"{m[f'{prefix}speedup']:.2f}x", m[f"{prefix}tau"],
             *[f"{m[key]:.2f}" for key in (f"{prefix}draft_ms_per_step", f"{prefix}verify_ms_per_step",
                                           f"{prefix}other_ms_per_step", "eval/live_plain_ms_per_token")],
             f"{m[f'{prefix}verify_over_plain']:.2f}"]
            for label, m in ((k, s["metrics"]) for k, s in summaries.items())
            for name, prefix in verifiers if f"{prefix}tokens_per_s" in m]
    if not rows:
        return
    out = out or sys.stdout
    out.write(f"\nmeasured on {_device(next(iter(summaries.values())))}, plain and speculative decoding alternated "
              f"request by request (a step: one block drafted and verified; verify/plain: a verification in plain decoding steps):\n")
    print_table(rows, ["drafter", "verify", "plain tok/s", "spec tok/s", "speedup", "tau", "draft ms/step",
                       "verify ms/step", "other ms/step", "plain ms/token", "verify/plain"], out)


def print_measured(label: str, summary: dict, verifiers: list[tuple[str, str]], out=None) -> None:
    """One line: the speedup measured here, per verifier, and plain decoding's tokens a second."""
    m = summary["metrics"]
    found = [(name, prefix) for name, prefix in verifiers if f"{prefix}tokens_per_s" in m]
    if not found:
        return
    ratios = ", ".join(f"{name} {m[f'{prefix}speedup']:.2f}x ({m[f'{prefix}tokens_per_s']:.1f} tok/s)"
                       for name, prefix in found)
    (out or sys.stdout).write(f"{label}: measured on {_device(summary)}: {ratios} against plain decoding's "
                              f"{m['eval/live_plain_tokens_per_s']:.1f} tok/s\n")


def print_serving(label: str, serving: dict | None, out=None) -> None:
    """One line: the serving model's speedup per concurrency from the chain's live tau (dflash.evaluate.serving),
    labelled as the prediction it is: no timing of this run enters it."""
    if not serving:
        return
    ratios = ", ".join(f"{r:.2f}x at C = {c}" for c, r in serving["speedup"].items())
    (out or sys.stdout).write(
        f"{label}: predicted for one {serving['gpu']} by the serving cost model (not measured): {ratios} (a "
        f"roofline model fed the live tau {serving['tau']:.3f} alone, {serving['context']} tokens of context, "
        f"{serving['output_tokens']:.0f} output tokens a request: eval.serving.gpu, eval.serving.concurrency)\n")


def print_slices(summaries: dict[str, dict], out=None) -> None:
    """A row per drafter and slice of eval.slices (teacher-forced eval/slice/..., live eval/live/slice/...): the walk's
    tau, its mean over prompts, blocks and prompts in the slice."""
    found = re.compile(r"eval/(?:live/)?slice/([^/]+)/([^/]+)/tau$")
    rows = []
    for label, summary in summaries.items():
        m = summary["metrics"]
        for key in m:
            if hit := found.fullmatch(key):
                base = key.removesuffix("/tau")
                rows.append([label, hit.group(1), hit.group(2), m[key], m[f"{base}/tau_macro"], m[f"{base}/blocks"],
                             m[f"{base}/prompts"]])
    if rows:
        (out or sys.stdout).write("\nby slice (eval.slices):\n")
        print_table(rows, ["drafter", "slice", "of", "tau", "tau_macro", "blocks", "prompts"], out)


def print_table(rows: list[list], header: list[str], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in header]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        out.write("  ".join(c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def reference_rows(references: list[dict], benchmarks: list[str]) -> list[dict]:
    """Published figures for a suite: each reference's tau on this suite's benchmarks, the mean over those it
    has (`covers` of them; a paper-style mean only when it covers all), its source and where its settings
    differ from this evaluation (`differs`, from dflash.evaluate.suite_results.setting_differences)."""
    rows = []
    for ref in references:
        tau = {b: float(v) for b, v in (ref.get("tau") or {}).items() if b in benchmarks}
        rows.append({"name": ref["name"], "source": ref["source"], "differs": ref.get("differs", []), "tau": tau,
                     "covers": len(tau), "mean": sum(tau.values()) / len(tau) if tau else None})
    return rows


def print_suite(suites: dict[str, dict], mode: str = "teacher_forced", out=None, top: int = 3) -> None:
    """Per benchmark, a row per drafter and a row per reference (published tau, `*` where its settings differ),
    then the mean over benchmarks (paper style: each benchmark weighs the same); then each drafter's best and
    worst prompts by tau, and the train/eval gap on the suite mean. The first tau column is the protocol's
    headline, the one references sit in: tau_macro (live: of live_tau_macro) when it averages over requests, then
    the pooled tau beside it; tau alone when it pools blocks."""

    out = out or sys.stdout
    first = next(iter(suites.values()))
    suite, benches, budgets = first["suite"], first["benchmarks"], first["ddtree_budgets"]
    refs = first.get("references", [])
    protocol = first.get("protocol") or {"name": None, "mean": "blocks"}  # a result from before the protocols
    taus = ["tau_macro", "tau"] if protocol["mean"] == "requests" else ["tau"]
    if mode == "live":
        header = ["benchmark", "drafter", *taus, "tok/forward", "tok/verify", "cost/verify", "speedup", "requests"]
        keys = [*[f"live_{t}" for t in taus], "live_tokens_per_forward", "live_tokens_per_verify", "live_verify_cost",
                "live_speedup", "live_requests"]
    else:
        sampled = any("eval/mean/tau_expected" in s["metrics"] for s in suites.values())
        expected = ["tau_expected"] if sampled else []
        header = ["benchmark", "drafter", *taus, *expected, "full", "tau_all", "acc@1",
                  *[f"ddtree@{n}" for n in budgets], "blocks", "prompts"]
        keys = [*taus, *expected, "full", "tau_all_anchors", "acc@1", *[f"ddtree@{n}" for n in budgets], "blocks",
                "prompts"]
    blank = ["-"] * (len(keys) - 1)
    rows = []
    for bench in [*benches, "mean"]:
        name = bench if bench != "mean" else f"mean ({len(benches)})"
        for label, s in suites.items():
            m = s["metrics"]
            rows.append([name, label, *[m.get(f"eval/{bench}/{k}", "-") for k in keys]])
        for ref in refs:
            label = ref["name"] + (" *" if ref["differs"] else "")
            if bench != "mean":
                rows.append([name, label, ref["tau"].get(bench, "-"), *blank])
            elif ref["mean"] is not None:
                cover = "" if ref["covers"] == len(benches) else f" ({ref['covers']} of {len(benches)})"
                rows.append([name, label + cover, ref["mean"], *blank])
    print_table(rows, header, out)
    if protocol["name"] is not None:
        what = ("the mean over requests (each user turn of each prompt) of each request's mean tau" if len(taus) > 1
                else "the mean over every block of the decoding walk")
        out.write(f"protocol {protocol['name']}: {taus[0]} is {what}; references are read against it\n")
    for ref in refs:
        differs = f"; settings differ: {', '.join(ref['differs'])}" if ref["differs"] else ""
        out.write(f"{ref['name']}{' *' if ref['differs'] else ''}: {ref['source']}{differs}\n")
    for label, s in suites.items():
        prompts = s.get("prompts", [])
        if prompts:
            def show(ps):
                return ", ".join(f"{p['benchmark']}/{p['prompt_id']} {p['tau']:.2f} ({p['blocks']} blocks)" for p in ps)
            out.write(f"{label}: best prompts {show(prompts[:top])}; worst {show(prompts[::-1][:top])}\n")
        if mode != "live":
            print_gap(f"{label} ({suite} mean)", {**mean_metrics(s), **s["metrics"]}, out)


def log_suite(logger, suite: dict, step: int) -> None:
    """A suite's eval/<bench>/* and eval/mean/* scalars at the checkpoint's step, and in W&B its tables:
    eval/prompts (every prompt: benchmark, id, tau, blocks), eval/benchmarks (tau per benchmark beside the
    references'). The run's best eval/tau is left to the single-set evaluations (another set of prompts)."""
    logger.log(suite["metrics"], step)
    if logger.wandb is None or suite.get("mode") == "other_settings":
        return
    import wandb

    m = suite["metrics"]
    tau = "live_tau" if suite.get("mode") == "live" else "tau"
    cols = ["benchmark", "prompt_id", "tau", "blocks", "tau_all_anchors"]
    prompts = wandb.Table(columns=cols, data=[[p.get(c) for c in cols] for p in suite["prompts"]])
    refs = suite.get("references", [])
    bench = wandb.Table(columns=["benchmark", "tau", *[r["name"] for r in refs]],
                        data=[[b, m[f"eval/{b}/{tau}"], *[r["tau"].get(b) for r in refs]] for b in suite["benchmarks"]])
    logger.log_media({"eval/prompts": prompts, "eval/benchmarks": bench}, step)


def mean_metrics(suite_summary: dict) -> dict:
    """The suite mean as plain eval/<metric> keys (what print_gap and train_gap read)."""
    prefix = "eval/mean/"
    return {"eval/" + k.removeprefix(prefix): v for k, v in suite_summary["metrics"].items() if k.startswith(prefix)}
