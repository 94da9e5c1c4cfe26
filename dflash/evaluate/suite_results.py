"""A suite's results: its per-benchmark summaries combined into one (eval/<bench>/<metric> and the paper-style
eval/mean/<metric>, each benchmark weighing the same), and the published reference figures shown beside them,
with the settings where each was measured differently from this evaluation. The benchmarks and protocols
themselves are in dflash.evaluate.suites.
"""

from __future__ import annotations

from pathlib import Path

from dflash.config import JobConfig
from dflash.errors import DataError, NotFoundError
from dflash.evaluate.suites import BENCHMARKS, PROTOCOLS, protocol_thinking


def live_per_prompt(records: list[dict]) -> dict[str, dict]:
    """Per-prompt table of live decoding (the single-path steps): mean tau and steps ("blocks") per prompt."""
    table: dict[str, list[int]] = {}
    for r in records:
        if r.get("tree_budget") is None:
            table.setdefault(r["prompt_id"], []).append(r["tau"])
    return {pid: {"tau": sum(t) / len(t), "blocks": len(t)} for pid, t in table.items()}


MEAN_KEYS = ("tau", "tau_macro", "full", "tau_all_anchors", "full_all_anchors", "live_tau", "live_tau_macro",
             "live_tokens_per_forward", "live_tokens_per_verify", "live_verify_cost", "live_speedup")


def combine(suite: str, summaries: dict[str, dict], protocol: str = "zlab") -> dict:
    """One drafter's suite result from its per-benchmark summaries: eval/<bench>/<metric> for every metric,
    eval/mean/<metric> the paper-style mean over benchmarks (each benchmark weighs the same, whatever its
    size) of the headline metrics (tau, tau_macro, full, tau_all_anchors, acc@k, ddtree@N, live tau, its mean
    over requests and tokens per forward), the per-prompt rows of every benchmark (`prompts`, best first), the
    summed tau histogram and the protocol (`protocol`: name, mean, and `headline`, the metric compared with
    references)."""
    metrics, prompts = {}, []
    for bench, s in summaries.items():
        metrics.update({f"eval/{bench}/{k.removeprefix('eval/')}": v for k, v in s["metrics"].items()})
        table = s.get("per_prompt") or {}
        prompts += [{"benchmark": bench, "prompt_id": pid, "tau": row["tau"], "blocks": row["blocks"],
                     **({"tau_all_anchors": row["tau_all_anchors"]} if "tau_all_anchors" in row else {})}
                    for pid, row in table.items() if "tau" in row]
    first = next(iter(summaries.values()))
    keys = [k for k in first["metrics"] if k.removeprefix("eval/") in MEAN_KEYS
            or k.startswith(("eval/acc@", "eval/ddtree@")) and "live" not in k]
    for k in keys + [k for k in first["metrics"] if k.startswith("eval/live_ddtree@")
                     and k.endswith(("_tau", "_tokens_per_forward", "_verify_cost"))]:
        values = [s["metrics"][k] for s in summaries.values() if k in s["metrics"]]
        metrics[f"eval/mean/{k.removeprefix('eval/')}"] = sum(values) / len(values)
    metrics["eval/mean/benchmarks"] = len(summaries)
    hists = [s["tau_histogram"] for s in summaries.values()]
    hist = [sum(h[i] for h in hists if i < len(h)) for i in range(max(map(len, hists)))]
    prompts.sort(key=lambda p: (-p["tau"], p["benchmark"], p["prompt_id"]))
    mode = first.get("mode", "teacher_forced")
    how = PROTOCOLS[protocol]
    return {"suite": suite, "benchmarks": list(summaries), "metrics": metrics, "prompts": prompts,
            "tau_histogram": hist, "block_size": first["block_size"], "ddtree_budgets": first["ddtree_budgets"],
            "mode": mode, "protocol": {"name": how.name, "mean": how.mean, "headline": how.headline(mode)}}


REFERENCES = Path(__file__).resolve().parents[2] / "conf" / "references"


def load_references(spec: str | None) -> list[dict]:
    """Published figures to show beside ours: eval.suite.references, a YAML file or the name of one shipped in
    conf/references/. Each entry: name, source (paper table or model card), protocol (a name in PROTOCOLS: how
    the figures were sampled, prompted and averaged), target, thinking, block_size, temperature (with top_p, top_k
    and verifier when sampled), and `tau` per benchmark name ({gsm8k: 6.5, ...}); settings not given are not
    compared."""
    if spec is None:
        return []
    path = Path(spec).expanduser()
    if not path.is_file() and "/" not in spec and not spec.endswith((".yaml", ".yml")):
        path = REFERENCES / f"{spec}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in REFERENCES.glob("*.yaml"))
        raise NotFoundError(f"eval.suite.references={spec}: no such file; give a YAML path or one of "
                            f"{', '.join(shipped)}")
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    refs = data.get("references") or []
    for n, ref in enumerate(refs):
        if not isinstance(ref, dict) or "name" not in ref or "source" not in ref:
            raise DataError(f"{path}: references[{n}] needs a name and a source (paper table or model card)")
        unknown = sorted(set(ref.get("tau") or {}) - set(BENCHMARKS))
        if unknown:
            raise DataError(f"{path}: references[{n}] ({ref['name']}) has tau for unknown benchmark(s) "
                            f"{', '.join(unknown)}; benchmarks: {', '.join(BENCHMARKS)}")
        if ref.get("protocol") is not None and ref["protocol"] not in PROTOCOLS:
            raise DataError(f"{path}: references[{n}] ({ref['name']}) has protocol {ref['protocol']!r}; known "
                            f"protocols: {', '.join(PROTOCOLS)} (dflash.evaluate.suites.PROTOCOLS)")
    return refs


def setting_differences(ref: dict, job: JobConfig, block_size: int) -> list[str]:
    """The settings where a reference was measured differently from this evaluation (protocol, target, thinking
    as eval.suite.protocol prompts with it, block size, temperature, and at temperature > 0 top-p, top-k and the
    verifier: rejection, seeded or a reference's exact_match of greedy drafts), each as 'what theirs (ours ...)';
    settings the reference leaves out are not compared. Thinking left to the chat template's default (on for
    Qwen3 targets) is never taken to agree: the template is not read here."""
    out, dec, suite = [], job.eval.decode, job.eval.suite
    if ref.get("protocol") is not None and ref["protocol"] != suite.protocol:
        out.append(f"protocol {ref['protocol']} (ours {suite.protocol})")
    target = ref.get("target")
    ours = {job.target.name.lower(), job.target.path.lower(), Path(job.target.path).name.lower()}
    if target is not None and str(target).lower() not in ours and Path(str(target)).name.lower() not in ours:
        out.append(f"target {target} (ours {job.target.path})")
    thinking = protocol_thinking(job.data, suite)
    if ref.get("thinking") is not None and (thinking is None or bool(ref["thinking"]) != thinking):
        said = "the chat template's default" if thinking is None else "on" if thinking else "off"
        out.append(f"thinking {'on' if ref['thinking'] else 'off'} (ours {said})")
    if ref.get("block_size") is not None and int(ref["block_size"]) != block_size:
        out.append(f"block size {ref['block_size']} (ours {block_size})")
    if ref.get("temperature") is not None and float(ref["temperature"]) != dec.temperature:
        out.append(f"temperature {ref['temperature']} (ours {dec.temperature})")
    if dec.temperature > 0 and float(ref.get("temperature") or 0) > 0:
        if ref.get("top_p") is not None and float(ref["top_p"]) != dec.top_p:
            out.append(f"top-p {ref['top_p']} (ours {dec.top_p})")
        if ref.get("top_k") is not None and int(ref["top_k"]) != dec.top_k:
            out.append(f"top-k {ref['top_k']} (ours {dec.top_k})")
        if ref.get("verifier") is not None and ref["verifier"] != dec.verifier:
            out.append(f"verifier {ref['verifier']} (ours {dec.verifier})")
    return out
