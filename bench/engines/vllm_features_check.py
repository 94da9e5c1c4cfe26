"""The vLLM features check: extract.py with features.source=vllm writes the features transformers computes, recorded
as vLLM's, never mixed with transformers', and both are timed side by side.

    python -m bench.engines --vllm-python .venv-engines/vllm/bin/python --fla-python - --only vllm_features

Runs in the main venv; vLLM runs in its venv through dflash/data/vllm_runtime/vllm_extract.py (on a CPU with the
connector shim of vllm_hidden_states.py beside it). On tiny_qwen3_hd32, for each of RUNS:
1. extract.py with features.source=hf, then with features.source=vllm on the same completions;
2. the manifest: kernel_backend engine=vllm and the attention backend vLLM ran, vLLM's version, its tensor
   parallel size (and a layout of its own above 1);
3. the features position for position: the largest difference relative to the largest feature, within RUNS'
   tolerance;
4. throughput: transformers' forward over the cache's sequences timed here (after one untimed pass) beside vLLM's
   extraction as vllm_extract.py timed it (its engine start apart), and each extract.py's wall time; the load
   of the machine before the check says whether they ran alone.
Then mixing (float32): extract.py through transformers into vLLM's cache is refused (another configuration), and a
drafter trained on vLLM's features is refused live evaluation on the transformers target (kernel_backend) unless
provenance.allow_mismatch=[kernel_backend] (then it runs: the refusal is the kernels').

--break layer_ids has vllm_extract.py hand vLLM our layer ids unshifted: the check must then fail.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.engines import REPO, run
from bench.engines.fla_check import compare, refused

TARGET = "tiny_qwen3_hd32"
RUNS = {"float32": ("float32", 1, 1e-5), "float32-tp2": ("float32", 2, 1e-5), "bfloat16": ("bfloat16", 1, 3e-2)}
"""name: (target.dtype, features.vllm.tensor_parallel, the largest |vLLM - transformers| over the largest |feature|
allowed). float32: the same computation in another order (measured 3.5e-7 at TP 1, 4.8e-7 at TP 2); bf16: a few
bf16 roundings through 8 layers (measured 1.0e-2; bf16 alone moves transformers' float32 features by 8.6e-3), as
fla_check allows."""


def common(work: Path, dtype: str) -> list[str]:
    # one completions store for every run (the first extraction's, in float32): the caches hold the same sequences
    return ["debug=tiny", f"target={TARGET}", f"target.dtype={dtype}", "data.completions.max_new_tokens=64",
            f"features.storage={dtype}", "features.shard_sequences=4",
            f"data.completions.path={work.parent / 'completions.jsonl'}"]


def hf_throughput(cache_dir: Path) -> dict:
    """transformers' features of the cache's sequences, as extraction batches them: tokens/s of a second pass."""
    import torch

    from bench.engines import compose_job
    from dflash.data.cache import FeatureCache
    from dflash.target import load_target
    from dflash.target.features import batched_features

    cache = FeatureCache(cache_dir, dtype=torch.float32)
    job = compose_job("extract", ["debug=tiny", f"target={TARGET}", f"target.dtype={cache.manifest['dtype']}"])
    target = load_target(job.target, torch.device("cpu"))
    seqs = [cache[i][0] for i in range(len(cache))]
    for _ in batched_features(target, seqs, cache.manifest["layer_ids"], job.features.batch_tokens):
        pass  # warm: the first pass pays for allocations the second reuses
    t0 = time.perf_counter()
    for _ in batched_features(target, seqs, cache.manifest["layer_ids"], job.features.batch_tokens):
        pass
    seconds = time.perf_counter() - t0
    tokens = sum(s.numel() for s in seqs)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}


def check_run(vllm_python: str, work: Path, name: str, broken: str | None) -> dict:
    dtype, tp, tolerance = RUNS[name]
    work.mkdir(parents=True, exist_ok=True)
    args = common(work, dtype)
    hf, vllm = work.parent / f"hf-{dtype}" / "features", work / "vllm" / "features"
    out: dict = {"dtype": dtype, "tensor_parallel": tp, "extract_py_s": {}}
    if not (hf / "manifest.json").exists():  # one transformers extraction per dtype
        t0 = time.perf_counter()
        run([sys.executable, "extract.py", *args, f"features.dir={hf}"], work / "extract-hf.log")
        out["extract_py_s"]["hf"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    run([sys.executable, "extract.py", *args, f"features.dir={vllm}", "features.source=vllm",
         f"features.vllm.python={vllm_python}", f"features.vllm.tensor_parallel={tp}"], work / "extract-vllm.log",
        env={"DFLASH_ENGINES_BREAK": broken or ""})
    out["extract_py_s"]["vllm"] = round(time.perf_counter() - t0, 1)
    manifest = json.loads((vllm / "manifest.json").read_text())
    engine = manifest["engine"]
    out.update(kernel_backend=manifest["kernel_backend"], versions=manifest["versions"], engine=engine,
               layout=manifest.get("layout"))
    out["provenance_recorded"] = (manifest["kernel_backend"].startswith("engine=vllm,")
                                  and engine["version"] is not None
                                  and engine["version"] == manifest["versions"].get("vllm")
                                  and engine["tensor_parallel"] == tp and manifest["dtype"] == dtype
                                  and (manifest.get("layout") is None) == (tp == 1))
    out["features"] = {**compare(hf, vllm), "tolerance": tolerance}
    out["within_tolerance"] = out["features"]["relative"] <= tolerance
    out["throughput"] = {"hf": hf_throughput(hf), "vllm": {
        "tokens": engine["tokens"], "seconds": engine["extract_s"], "load_s": engine["load_s"],
        "tokens_per_s": round(engine["tokens"] / max(engine["extract_s"], 1e-9))}}
    out["ok"] = out["provenance_recorded"] and out["within_tolerance"]
    return out


def check_mixing(vllm_python: str, work: Path) -> dict:
    """Transformers' extraction into vLLM's float32 cache, and a drafter trained on it evaluated live through
    transformers: both refused; the evaluation allowed the kernel difference runs."""
    args = common(work, "float32")
    vllm = work / "float32" / "vllm" / "features"
    out = {"resume_refused": refused([sys.executable, "extract.py", *args, f"features.dir={vllm}"],
                                     work / "resume-hf.log", "another configuration", {})}
    runs = [f"run.root={work / 'runs'}", "run.name=vllm", f"features.dir={vllm}",
            f"eval.features_dir={work / 'heldout'}"]
    # its in-run evaluation reads a held-out set transformers extracted: refused too, unless allowed
    run([sys.executable, "train.py", *args, *runs, "train.max_steps=4", "provenance.allow_mismatch=[kernel_backend]"],
        work / "train-vllm.log")
    live = ["eval=live", "eval.max_prompts=1", "eval.max_new_tokens=8", "eval.ddtree_budgets=[]", "checkpoint=latest"]
    out["evaluate_refused"] = refused([sys.executable, "evaluate.py", *args, *runs, *live], work / "evaluate.log",
                                      "kernel_backend", {})
    out["evaluate_allowed_runs"] = run([sys.executable, "evaluate.py", *args, *runs, *live,
                                        "provenance.allow_mismatch=[kernel_backend]"], work / "evaluate-allowed.log",
                                       check=False) == 0
    out["ok"] = out["resume_refused"]["refused"] and out["evaluate_refused"]["refused"] and out["evaluate_allowed_runs"]
    return out


def check(vllm_python: str, work: Path, broken: str | None = None, runs: list[str] | None = None) -> dict:
    shutil.rmtree(work, ignore_errors=True)  # fresh caches: a check that resumed old ones would prove nothing
    load = os.getloadavg()
    result = {"target": TARGET, "break": broken, "runs": {},
              # another process's load makes the throughput figures say little: 1-minute load before the check
              "loadavg_before": [round(x, 2) for x in load], "alone": load[0] < 0.5}
    for name in runs or list(RUNS):
        result["runs"][name] = check_run(vllm_python, work / name, name, broken)
    if "float32" in result["runs"]:
        result["mixing"] = check_mixing(vllm_python, work)
    result["versions"] = next(iter(result["runs"].values()))["versions"]
    result["ok"] = all(r["ok"] for r in result["runs"].values()) and result.get("mixing", {}).get("ok", True)
    return result


def verdict(result: dict) -> str:
    v = result["versions"]
    busy = "" if result["alone"] else "; the machine was busy: throughput is indicative"
    lines = [f"vLLM features check (vllm {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}"
             f", on {result['target']}{busy}):"]
    for name, r in result["runs"].items():
        f, t = r["features"], r["throughput"]
        lines.append(
            f"  {name}: provenance {'recorded' if r['provenance_recorded'] else 'NOT RECORDED'} ({r['kernel_backend']}"
            f"); features {'within' if r['within_tolerance'] else 'OUTSIDE'} tolerance (max diff "
            f"{f['max_abs_diff']:.2e} = {f['relative']:.1e} of the largest feature, tolerance {f['tolerance']:.0e}; "
            f"{f['tokens']} tokens); {t['vllm']['tokens_per_s']} tok/s through vLLM (its start "
            f"{t['vllm']['load_s']:.0f} s apart), {t['hf']['tokens_per_s']} tok/s through transformers")
    if "mixing" in result:
        m = result["mixing"]
        lines.append(f"  mixing with transformers' features {'refused' if m['ok'] else 'NOT REFUSED'} (resume: "
                     f"{m['resume_refused']['refused']}, live evaluation: {m['evaluate_refused']['refused']}, allowed "
                     f"knowingly runs: {m['evaluate_allowed_runs']})")
    lines.append(f"vLLM features check: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)
