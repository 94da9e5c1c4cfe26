"""The fla check: extraction through fla's kernels (interpreted on the CPU) is recorded as such, agrees with
the PyTorch fallback's within tolerance, and our guards never mix the two.

    python -m bench.engines.fla_check --fla-python .venv-engines/fla/bin/python [--break backend]

Runs in the main venv, which has no fla (transformers binds its PyTorch fallback there); the fla side runs
our entry points in the fla venv through `bench.engines.interpret`. On tiny_qwen3_5 (6 Gated DeltaNet layers
and 2 full-attention ones), for each dtype of DTYPES:
1. extract.py in the main venv (fallback), then in the fla venv on the same completions (fla);
2. the manifests: fla's says linear_attention=fla with flash-linear-attention's version, the fallback's
   torch_fallback, and their kernel_backend differs;
3. the features, position for position: the largest difference relative to the largest feature, within
   DTYPES' tolerance;
4. mixing refused: extract.py in the fla venv into the fallback's cache (refused: another configuration), and a
   drafter trained on the fallback's features evaluated live on the fla target (refused: kernel_backend); the
   same evaluation in the main venv runs, so the refusal is the kernels'.

--break backend makes the fla side report the fallback's kernels: the check must then fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.engines import REPO, run

TARGET = "tiny_qwen3_5"
DTYPES = {"float32": 1e-4, "bfloat16": 3e-2}
"""target.dtype: the largest |fla - fallback| over the largest |feature| allowed. float32: the two compute the
same recurrence in other orders (chunked vs step by step), and an error of 0.1% in the linear-attention output
moves the features by more than this (`sensitivity` measures it each run); bf16: a few bf16 roundings (2^-8)
through 8 layers, about what bf16 itself moves the fallback's features from float32 (`bf16_noise`)."""
SENSITIVITY = 1e-3  # the relative error put into the linear-attention output to see what the tolerance can see


def common(work: Path, dtype: str) -> list[str]:
    # one completions store for every dtype (what generated them is the fallback in float32, the first run):
    # every cache then holds the same sequences, compared position for position
    return ["debug=tiny", f"target={TARGET}", f"target.dtype={dtype}", "data.limit=4",
            "data.completions.max_new_tokens=16", f"features.storage={dtype}",
            f"data.completions.path={work.parent / 'completions.jsonl'}"]


def sensitivity(fallback: Path) -> float:
    """How far the fallback's features move (relative to the largest) when the linear-attention layers' output
    is off by SENSITIVITY: what a kernel that far off would show. Recomputed here from the cache's sequences."""
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    from bench.engines import compose_job
    from dflash.data.cache import FeatureCache
    from dflash.target import load_target
    from dflash.target.features import target_forward

    cache = FeatureCache(fallback, dtype=torch.float32)
    target = load_target(compose_job("extract", ["debug=tiny", f"target={TARGET}"]).target, torch.device("cpu"))
    layer_ids = cache.manifest["layer_ids"]
    real = qwen3_5.torch_chunk_gated_delta_rule

    def off(*args, **kwargs):
        out, state = real(*args, **kwargs)
        return out * (1 + SENSITIVITY), state

    moved, scale = 0.0, 0.0
    for i in range(len(cache)):
        ids = cache[i][0][None]
        exact = target_forward(target, ids, layer_ids).features
        qwen3_5.torch_chunk_gated_delta_rule = off
        try:
            wrong = target_forward(target, ids, layer_ids).features
        finally:
            qwen3_5.torch_chunk_gated_delta_rule = real
        moved, scale = max(moved, (wrong - exact).abs().max().item()), max(scale, exact.abs().max().item())
    return moved / scale


def compare(fallback: Path, fla: Path) -> dict:
    import torch

    from dflash.data.cache import FeatureCache

    a, b = FeatureCache(fallback, dtype=torch.float32), FeatureCache(fla, dtype=torch.float32)
    if a.ids != b.ids:
        raise SystemExit(f"the two caches hold other sequences: {a.ids} vs {b.ids}")
    diff, scale, tokens = 0.0, 0.0, 0
    for i in range(len(a)):
        ids_a, _, fa = a[i]
        ids_b, _, fb = b[i]
        if not torch.equal(ids_a, ids_b):
            raise SystemExit(f"sequence {a.ids[i]} has other tokens in the two caches")
        diff = max(diff, (fa - fb).abs().max().item())
        scale = max(scale, fa.abs().max().item())
        tokens += ids_a.numel()
    return {"sequences": len(a), "tokens": tokens, "max_abs_diff": diff, "max_abs_feature": scale,
            "relative": diff / scale}


def refused(cmd: list[str], log: Path, phrase: str, env: dict) -> dict:
    """Whether cmd exits 2 (a dflash error) with `phrase` in what it said."""
    rc = run(cmd, log, env=env, check=False)
    said = log.read_text()
    return {"refused": rc == 2 and phrase in said, "exit": rc,
            "message": next((line for line in said.splitlines() if phrase in line), said.strip()[-300:])}


def check_dtype(fla_python: str, work: Path, dtype: str, broken: str | None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    args = common(work, dtype)
    fla_env = {"DFLASH_ENGINES_BREAK": broken or ""}
    interpret = [fla_python, "-m", "bench.engines.interpret"]
    fallback, fla = work / "fallback" / "features", work / "fla" / "features"
    t0 = time.perf_counter()
    run([sys.executable, "extract.py", *args, f"features.dir={fallback}"], work / "extract-fallback.log")
    fallback_s, t0 = time.perf_counter() - t0, time.perf_counter()
    run([*interpret, "extract.py", *args, f"features.dir={fla}"], work / "extract-fla.log", env=fla_env)
    fla_s = time.perf_counter() - t0
    manifests = {k: json.loads((d / "manifest.json").read_text()) for k, d in (("fallback", fallback), ("fla", fla))}
    backends = {k: m["kernel_backend"] for k, m in manifests.items()}
    kernels = {k: m["kernels"]["linear_attention"] for k, m in manifests.items()}
    out = {"extract_s": {"fallback": round(fallback_s, 1), "fla": round(fla_s, 1)}, "kernel_backend": backends,
           "versions": manifests["fla"]["versions"],
           "backend_recorded": kernels == {"fallback": "torch_fallback", "fla": "fla"}
           and backends["fla"] != backends["fallback"]
           and manifests["fla"]["versions"].get("flash-linear-attention") is not None}
    out["features"] = compare(fallback, fla)
    out["features"]["tolerance"] = DTYPES[dtype]
    out["within_tolerance"] = out["features"]["relative"] <= DTYPES[dtype]
    if dtype == "float32":
        out["features"]["sensitivity"] = {"kernel_error": SENSITIVITY, "relative": sensitivity(fallback)}
        # a tolerance that a 0.1% kernel error stays within would pass broken kernels
        out["within_tolerance"] &= out["features"]["sensitivity"]["relative"] > DTYPES[dtype]
    # mixing: fla into the fallback's cache, and a drafter trained on fallback features evaluated on fla's
    out["resume_refused"] = refused([*interpret, "extract.py", *args, f"features.dir={fallback}"],
                                    work / "resume-fla.log", "another configuration", fla_env)
    runs = [f"run.root={work / 'runs'}", "run.name=fallback", f"features.dir={fallback}",
            f"eval.features_dir={work / 'heldout'}"]
    run([sys.executable, "train.py", *args, *runs, "train.max_steps=4"], work / "train-fallback.log")
    live = ["eval=live", "eval.max_prompts=1", "eval.max_new_tokens=8", "eval.ddtree_budgets=[]", "checkpoint=latest"]
    out["evaluate_refused"] = refused([*interpret, "evaluate.py", *args, *runs, *live], work / "evaluate-fla.log",
                                      "kernel_backend", fla_env)
    out["evaluate_fallback_runs"] = run([sys.executable, "evaluate.py", *args, *runs, *live],
                                        work / "evaluate-fallback.log", check=False) == 0
    out["mixing_refused"] = (out["resume_refused"]["refused"] and out["evaluate_refused"]["refused"]
                             and out["evaluate_fallback_runs"])
    out["ok"] = out["backend_recorded"] and out["within_tolerance"] and out["mixing_refused"]
    return out


def check(fla_python: str, work: Path, broken: str | None = None, dtypes: list[str] | None = None) -> dict:
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # fresh caches: a check that resumed old ones would prove nothing
    result = {"target": TARGET, "break": broken, "dtypes": {}}
    for dtype in dtypes or list(DTYPES):
        result["dtypes"][dtype] = check_dtype(fla_python, work / dtype, dtype, broken)
    result["versions"] = next(iter(result["dtypes"].values()))["versions"]
    if {"float32", "bfloat16"} <= set(result["dtypes"]):  # what bf16 alone does to the fallback's features
        result["bf16_noise"] = compare(work / "float32" / "fallback" / "features",
                                       work / "bfloat16" / "fallback" / "features")["relative"]
    result["ok"] = all(d["ok"] for d in result["dtypes"].values())
    return result


def verdict(result: dict) -> str:
    v = result["versions"]
    lines = [f"fla check (flash-linear-attention {v.get('flash-linear-attention')}, torch {v.get('torch')}, "
             f"transformers {v.get('transformers')}, Triton's interpreter, on {result['target']}):"]
    for dtype, d in result["dtypes"].items():
        f = d["features"]
        lines.append(
            f"  {dtype}: backend {'recorded' if d['backend_recorded'] else 'NOT RECORDED'} "
            f"({d['kernel_backend']['fla']}); features {'within' if d['within_tolerance'] else 'OUTSIDE'} tolerance "
            f"(max diff {f['max_abs_diff']:.2e} = {f['relative']:.1e} of the largest feature, tolerance "
            f"{f['tolerance']:.0e}; {f['tokens']} tokens); mixing {'refused' if d['mixing_refused'] else 'NOT REFUSED'}"
            f"; extraction {d['extract_s']['fla']:.0f} s (fallback {d['extract_s']['fallback']:.0f} s)")
    sens = result["dtypes"].get("float32", {}).get("features", {}).get("sensitivity")
    if sens:
        lines.append(f"  (a {sens['kernel_error']:.1%} error in the linear-attention output would move the float32 "
                     f"features by {sens['relative']:.1e}"
                     + (f"; bf16 moves the fallback's by {result['bf16_noise']:.1e}" if "bf16_noise" in result else "")
                     + ")")
    lines.append(f"fla check: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fla-python", required=True, help="python of the fla venv")
    parser.add_argument("--work", default=str(REPO / "build" / "engines" / "fla"))
    parser.add_argument("--out", help="write the result JSON here")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="only these (default: all)")
    parser.add_argument("--break", dest="broken", choices=["backend"], help="a deliberate break the check must catch")
    args = parser.parse_args()
    result = check(args.fla_python, Path(args.work), args.broken, args.dtype)
    print(verdict(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
