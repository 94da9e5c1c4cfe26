"""Speculative sampling, ours against the z-lab reference decoder, on one checkpoint (issue: sampling at
temperature). Both decode the same held-out prompts at the same temperature / top-p / top-k with the same
drafter weights: ours (dflash.drafter.decoding.engine.speculative_generate, rejection sampling) and the reference's
`dflash_generate` (`dflash` 0.1.0 model.py, unpacked by `make test` beside the venv, imported under another
name). The figure is the tau each reaches (tokens committed per verification, pooled over prompts, with its
standard error over prompts); the texts differ (each samples), so only the distributions of tau compare. At
temperature 0 both outputs are also compared with plain greedy decoding (`*_equals_plain_greedy`): a decoder that
is not lossless on the target writes other text, and its tau is then not comparable.

    python -m bench.sampling_reference checkpoint=runs/dflash2/dflash-s0/checkpoints/step-000768 \\
        temperature=1.0 prompts=32 seeds=2 out=bench/results/2026-12-03-cpu2-sampling-reference.json

key=value arguments: checkpoint (a drafter directory), temperature, top_p, top_k, prompts, seeds,
max_new_tokens, out; the target and the prompts are the default (toy) evaluation's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch


def reference_module():
    path = Path(sys.prefix) / "zlab-dflash-0.1.0" / "dflash" / "model.py"
    if not path.exists():
        raise SystemExit(f"{path} is missing: `make .venv/.dev` (make test) unpacks the reference wheel there")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["zlab_dflash_model"] = module
    spec.loader.exec_module(module)
    module._cuda_time = time.perf_counter  # its stats time with CUDA syncs
    return module


def main(argv: list[str]) -> dict:
    args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "prompts": 32, "seeds": 2, "max_new_tokens": 256,
            "out": None, "checkpoint": None}
    for a in argv:
        key, _, value = a.partition("=")
        if key not in args:
            raise SystemExit(f"unknown argument {key!r}: one of {', '.join(args)}")
        args[key] = type(args[key])(value) if args[key] is not None else value
    if not args["checkpoint"]:
        raise SystemExit("checkpoint=<a drafter directory> is required")
    from hydra import compose, initialize_config_dir

    from dflash.cli import to_job
    from dflash.config import register_configs
    from dflash.data.prompts import encode, load_prompts, prompt_text
    from dflash.drafter.build import load_drafter
    from dflash.drafter.decoding.engine import greedy_generate, speculative_generate
    from dflash.drafter.metrics import ratio_se
    from dflash.target import load_target

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        job = to_job(compose("evaluate", []))
    ref = reference_module()
    target = load_target(job.target)
    ours = load_drafter(args["checkpoint"]).float().eval()
    kind = ref.DFlash2DraftModel if ours.candidate_selector is not None else ref.DFlashDraftModel
    theirs = kind.from_pretrained(args["checkpoint"]).float().eval()
    stops = target.stop_token_ids()
    knobs = {k: args[k] for k in ("temperature", "top_p", "top_k")}
    prompts = load_prompts(job.eval.prompts, limit=args["prompts"])
    per = {"ours": [], "reference": []}
    equal = {"ours": 0, "reference": 0}  # temperature 0: outputs equal to plain greedy decoding (lossless)
    t0 = time.perf_counter()
    for n, prompt in enumerate(prompts):
        text = prompt_text(target.tokenizer, prompt, job.data.chat_template, job.data.enable_thinking)
        ids = torch.tensor([encode(target.tokenizer, text)], device=target.device)
        for seed in range(args["seeds"]):
            spec = speculative_generate(ours, target, ids, args["max_new_tokens"], stop_token_ids=stops,
                                        seed=seed * 100_003 + n, **knobs)
            mine = spec.acceptance_lengths
            torch.manual_seed(seed * 100_003 + n)
            with torch.no_grad():
                out = ref.dflash_generate(theirs, target.model, ids, args["max_new_tokens"], stop_token_ids=stops,
                                          return_stats=True, **knobs)
            if args["temperature"] <= 0:
                plain = greedy_generate(target, ids, args["max_new_tokens"], stop_token_ids=stops)
                equal["ours"] += torch.equal(spec.output_ids, plain)
                equal["reference"] += torch.equal(out.output_ids, plain)
            per["ours"].append((sum(mine), len(mine)))
            per["reference"].append((sum(out.acceptance_lengths), len(out.acceptance_lengths)))
    kind_name = "dflash2" if ours.candidate_selector is not None else "dflash"
    result = {"checkpoint": args["checkpoint"], "drafter": kind_name,
              **knobs, "prompts": len(prompts), "seeds": args["seeds"], "max_new_tokens": args["max_new_tokens"],
              "wall_s": round(time.perf_counter() - t0, 1)}
    for name, pairs in per.items():
        result[f"{name}_tau"] = sum(x for x, _ in pairs) / sum(y for _, y in pairs)
        result[f"{name}_tau_se"] = ratio_se(pairs)
        result[f"{name}_blocks"] = sum(y for _, y in pairs)
    if args["temperature"] <= 0:
        result.update({f"{name}_equals_plain_greedy": f"{n} of {len(per[name])}" for name, n in equal.items()})
    diff = [a[0] / a[1] - b[0] / b[1] for a, b in zip(per["ours"], per["reference"])]
    mean = sum(diff) / len(diff)
    result["paired_macro_diff"] = mean
    result["paired_macro_diff_se"] = (sum((d - mean) ** 2 for d in diff) / (len(diff) - 1) / len(diff)) ** 0.5
    text = json.dumps(result, indent=2)
    print(text)
    if args["out"]:
        Path(args["out"]).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
