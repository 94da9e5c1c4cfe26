"""The vLLM check: vLLM's CPU build serves drafters that train.py trained, and agrees with our live evaluation.

    python -m bench.engines.vllm_check --vllm-python .venv-engines/vllm/bin/python [--case smollm2_135m]
                                       [--break layer_ids]

Runs in the main venv (train.py, evaluate.py and Hugging Face generation), and serves through
`vllm_serve.py` in the vLLM venv. Two targets (CASES): tiny_qwen3_hd32 (vLLM's CPU attention has no kernel for
head width 16) with a drafter of each attention layout, and a real published model, SmolLM2-135M-Instruct (a Llama
target, from its GGUF file), with a drafter trained briefly on ShareGPT. For each drafter export it checks:
- target-only vLLM greedy = Hugging Face greedy, token for token, on every prompt;
- vLLM + the drafter = target-only vLLM (lossless);
- vLLM's accepted drafts at each verify step = our live evaluation's (tau - 1), the last step capped at what
  the budget left (vLLM counts drafts it accepted past max_tokens and then drops);
- every attention key we write, read back: each drafter layer's (window, causal) as vLLM built it = our
  `attention_rules` of the export's config.json, and the config keys themselves in vLLM's resolved config.
An export vLLM's CPU path cannot serve is recorded with vLLM's reason; it fails the check unless the case
expects it (and then a vLLM that starts serving it is compared like the others).

--break layer_ids hands vLLM an export whose target_layer_ids are shifted by one from the ones the drafter
was trained and evaluated with: the check must then fail.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.engines import REPO, compose_job, run


@dataclass(frozen=True)
class Case:
    """A target the check serves, and the drafters it trains for it."""
    target: str         # the name of the target the case's overrides give
    common: list[str]   # the overrides of every train.py and evaluate.py command of the case
    steps: int          # training steps of each drafter: partly trained, so that step-for-step equality says something
    eval: list[str]     # the live evaluation both engines are held to
    exports: dict       # name: (drafter overrides of train.py, a phrase of vLLM's error when its CPU build refuses it)
    # whose acceptance is held to ours step for step: vLLM serving the prompts together (batched), or one at a time
    # (max_num_seqs=1), as our live evaluation decodes them; the other way is served too and must be lossless
    acceptance_from: str = "batched"


CASES = {
    # 100 steps: the drafters accept 0 to 7 drafts
    "tiny_qwen3_hd32": Case(
        target="tiny_qwen3_hd32", common=["debug=tiny", "target=tiny_qwen3_hd32", "logger=none"], steps=100,
        eval=["eval=live", "eval.prompts=builtin:tiny_prompts", "eval.max_prompts=6", "eval.ddtree_budgets=[]"],
        exports={
            "full": ([], None),
            "sliding": (["drafter.layer_types=[sliding_attention,sliding_attention]", "drafter.sliding_window=8"],
                        None),
            # vLLM 0.32 serves mixed sliding/full drafters (the Qwen3.6-27B shape) with its V2 model runner only,
            # which needs Triton, and DFlash 2's selector walk is a Triton kernel: neither runs on its CPU build
            "mixed": (["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=8"],
                      "Model Runner V1 does not support: mixed sliding/full dflash drafts"),
            "dflash2": (["drafter=dflash2", "drafter.num_layers=2", "drafter.selector_rank=32"],
                        "Model Runner V1 does not support: DFlash candidate-head drafts"),
        }),
    # A real model: SmolLM2-135M-Instruct from its GGUF file (the `real` extra), the CPU recipe's drafter shape
    # trained on the first 96 ShareGPT conversations' 64-token answers, in float32 throughout (in bf16 two engines
    # may round a near tie apart, and then neither is wrong); 8 held-out ShareGPT prompts (up to 2425 tokens long)
    # x 64 tokens, for training's held-out set as for the live evaluation
    "smollm2_135m": Case(
        target="smollm2_135m",
        common=["experiment=smollm2_135m_cpu", "target.dtype=float32", "train.mixed_precision=no", "logger=none",
                "data.name=vllm_check", "data.limit=96", "data.max_length=512", "data.completions.max_new_tokens=64",
                "data.completions.path=cache/smollm2_135m/vllm_check/completions.jsonl", "train.batch_size=2",
                "train.num_anchors=16", "train.save_every=1000000", "eval.max_prompts=8", "eval.max_new_tokens=64"],
        steps=300,
        eval=["eval=live", "eval.ddtree_budgets=[]", "eval.decode.warmup_tokens=0"],
        exports={"full": ([], None)},
        # batched, vLLM accepted one draft fewer than ours on 1-2 prompts, each within the last 7 tokens of the 64-token
        # budget (7, 4 and 1 tokens left; one where our first draft led by a logit margin of 0.25): at a 96-token
        # budget those positions agree, batched and alone. One request at a time (max_num_seqs=1), vLLM accepts as
        # ours does at every step, the budget's end included; the batched serving is reported
        acceptance_from="alone"),
}
"""name: the case (named by its target)."""


def train_and_evaluate(case: Case, name: str, overrides: list[str], work: Path) -> tuple[Path, dict]:
    """Train a drafter with train.py, evaluate it live with evaluate.py; its export and our per-prompt taus."""
    runs = ["run.root=" + str(work / "runs"), f"run.name={name}"]
    py, steps = sys.executable, case.steps
    run([py, "train.py", *case.common, *overrides, *runs, f"train.max_steps={steps}"], work / f"{name}-train.log")
    run([py, "evaluate.py", *case.common, *overrides, *runs, *case.eval, "checkpoint=latest"],
        work / f"{name}-eval.log")
    export = work / "runs" / name / "checkpoints" / f"step-{steps:06d}"
    taus: dict[str, list[int]] = {}
    # the case's eval settings are not the run's own: evaluate.py names the folder by what differs
    # (dflash.evaluate.settings)
    found = sorted((work / "runs" / name / "eval").glob(f"step-{steps:06d}-live*/blocks.jsonl"))
    if len(found) != 1:
        raise SystemExit(f"expected one live evaluation of {name} at step {steps}, found {[str(f) for f in found]}")
    for line in found[0].read_text().splitlines():
        r = json.loads(line)
        if r["tree_budget"] is None:
            taus.setdefault(r["prompt_id"], []).append(r["tau"])
    return export, taus


def requests(case: Case) -> tuple[dict, list[str], list[list[int]], list[list[int]]]:
    """The prompts as our live evaluation tokenizes them, and Hugging Face greedy continuations of them."""
    import torch

    from dflash.data.prompts import encode, load_prompts, prompt_text, turn_messages
    from dflash.target import load_target

    job = compose_job("evaluate", [*case.common, *case.eval])
    target = load_target(job.target, torch.device("cpu"))
    if job.data.completions.stop:
        raise SystemExit("the vLLM check passes stop token ids only; data.completions.stop must be empty")
    prompts = load_prompts(job.eval.prompts, limit=job.eval.max_prompts)
    ids = [encode(target.tokenizer, prompt_text(target.tokenizer, turn_messages(p, 0, []), job.data.chat_template,
                                                job.data.enable_thinking, job.data.chat_template_kwargs))
           for p in prompts]
    stops = sorted(target.stop_token_ids())
    hf = []
    for x in ids:
        out = target.model.generate(torch.tensor([x]), do_sample=False, max_new_tokens=job.eval.max_new_tokens,
                                    eos_token_id=stops, pad_token_id=target.tokenizer.pad_token_id)
        hf.append(out[0, len(x):].tolist())
    # room for the longest prompt, its answer and a block of drafts past it
    room = max(map(len, ids)) + job.eval.max_new_tokens + job.drafter.block_size
    request = {"target": str(Path(job.target.path).expanduser()), "prompts": ids, "max_tokens": job.eval.max_new_tokens,
               "stop_token_ids": stops, "dtype": job.target.dtype, "max_model_len": max(512, room)}
    return request, [p.id for p in prompts], ids, [h[:cut(h, stops)] for h in hf]


def cut(tokens: list[int], stops: list[int]) -> int:
    """Length of a continuation up to and including its first stop token (generate pads after it)."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))


def serve(vllm_python: str, request: dict, path: Path) -> dict:
    path.with_suffix(".request.json").write_text(json.dumps(request))
    path.unlink(missing_ok=True)
    # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache, a few MB are needed (its default reserves a share of the memory)
    run([vllm_python, REPO / "bench" / "engines" / "vllm_serve.py", path.with_suffix(".request.json"), path],
        path.with_suffix(".log"), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, check=False)
    if not path.exists():
        raise SystemExit(f"vllm_serve.py wrote no answer; see {path.with_suffix('.log')}")
    return json.loads(path.read_text())


def capped(accepted: list[int], output: list[int]) -> list[int]:
    """vLLM's accepted drafts per verify step, each capped at what the output kept of that step (the first
    token came from the prefill; a step adds its accepted drafts and one token of the target's)."""
    out, made = [], 1
    for a in accepted:
        room = max(0, len(output) - made - 1)
        out.append(min(a, room))
        made += out[-1] + 1
    return out


def served_taus(answer: dict) -> list[list[int]]:
    """Each prompt's tokens per verify step as vLLM served it (accepted drafts + 1, capped at what the output kept),
    comparable with our live evaluation's taus."""
    return [[a + 1 for a in capped(acc, out)] for acc, out in zip(answer["accepted"], answer["outputs"])]


def mean_tau(taus: list[list[int]]) -> float:
    """Tokens per verify step over every step of every prompt."""
    return sum(map(sum, taus)) / max(1, sum(map(len, taus)))


def attention_checks(export: Path, answer: dict) -> list[str]:
    """Where vLLM reads our export's attention keys differently from us; empty when it reads them all alike."""
    from types import SimpleNamespace

    from dflash.drafter.attention import attention_rules

    ours = json.loads((export / "config.json").read_text())
    rules = attention_rules(SimpleNamespace(**ours))
    theirs = answer["draft_layers"]
    problems = [f"layer {i}: ours (window {r.window}, causal {r.causal}), vLLM {t}"
                for i, (r, t) in enumerate(zip(rules, theirs))
                if (r.window, r.causal) != (t["sliding_window"], t["causal"])]
    if len(rules) != len(theirs):
        problems.append(f"{len(rules)} layers in config.json, {len(theirs)} built by vLLM")
    resolved = answer["draft_config"]
    for key in ("layer_types", "sliding_window", "is_causal", "block_size", "num_hidden_layers"):
        if key in ours and ours[key] != resolved.get(key) and not (key == "sliding_window" and ours[key] is None):
            problems.append(f"{key}: ours {ours[key]!r}, vLLM resolved {resolved.get(key)!r}")
    for key, value in (ours.get("dflash_config") or {}).items():
        if (resolved.get("dflash_config") or {}).get(key) != value:
            problems.append(f"dflash_config.{key}: ours {value!r}, vLLM resolved "
                            f"{(resolved.get('dflash_config') or {}).get(key)!r}")
    return problems


def check_case(case: Case, vllm_python: str, work: Path, broken: str | None, exports: list[str]) -> dict:
    """The exports `exports` of `case` against vLLM run by `vllm_python`: the findings, `ok` for all."""
    shutil.rmtree(work, ignore_errors=True)  # drafters trained now: runs left by an earlier check would resume
    work.mkdir(parents=True)
    request, names, prompts, hf = requests(case)
    plain = serve(vllm_python, {**request, "drafter": None}, work / "target-only.json")
    if "error" in plain:
        raise SystemExit(f"vLLM did not serve the target alone: {plain['error']} (see {work / 'target-only.log'})")
    result = {"engine": plain["versions"], "target": case.target, "prompts": len(prompts),
              "prompt_tokens": [len(p) for p in prompts], "max_tokens": request["max_tokens"],
              "dtype": request["dtype"], "steps": case.steps, "break": broken,
              "target_only_equals_hf": plain["outputs"] == hf,
              "target_only_mismatches": [n for n, a, b in zip(names, plain["outputs"], hf) if a != b],
              "exports": {}}
    for name in exports:
        overrides, refusal = case.exports[name]
        export, taus = train_and_evaluate(case, name, overrides, work)
        config = json.loads((export / "config.json").read_text())
        block = config["block_size"]
        served = export
        if broken == "layer_ids":  # what vLLM is handed says other layers than the drafter was trained on
            served = work / f"{name}-broken"
            shutil.rmtree(served, ignore_errors=True)
            shutil.copytree(export, served)
            config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
            (served / "config.json").write_text(json.dumps(config, indent=2))
        spec = {**request, "drafter": str(served), "num_speculative_tokens": block - 1}
        answer = serve(vllm_python, spec, work / f"{name}.json")
        alone = None
        if case.acceptance_from == "alone" and "error" not in answer:
            alone = serve(vllm_python, {**spec, "engine_args": {"max_num_seqs": 1}}, work / f"{name}-alone.json")
            if "error" in alone:
                raise SystemExit(f"vLLM served {name} batched but not one request at a time: {alone['error']} "
                                 f"(see {work / (name + '-alone.log')})")
        entry = {"drafter": overrides, "block_size": block, "layer_types": config.get("layer_types"),
                 "architectures": config.get("architectures")}
        if "error" in answer:
            entry.update(served=False, error=answer["error"][:500],
                         expected=bool(refusal) and refusal in answer["error"],
                         ok=bool(refusal) and refusal in answer["error"])
            result["exports"][name] = entry
            continue
        ours = [taus[n] for n in names]
        held = alone or answer  # the serving whose acceptance is compared with ours
        theirs = served_taus(held)
        attention = attention_checks(export, answer)
        if alone is not None:
            batched = served_taus(answer)
            entry.update(acceptance_from="alone", batched_lossless=answer["outputs"] == plain["outputs"],
                         batched_acceptance_mismatches=[n for n, a, b in zip(names, ours, batched) if a != b],
                         batched_vllm_tau=mean_tau(batched), batched_generate_s=answer["generate_s"])
        entry.update(
            served=True, lossless=all(a["outputs"] == plain["outputs"] for a in (answer, held)),
            acceptance_equal=ours == theirs, attention_read_alike=not attention, attention_problems=attention,
            our_tau=mean_tau(ours), vllm_tau=mean_tau(theirs), vllm_raw_accepted=held["accepted"], our_taus=ours,
            acceptance_mismatches=[n for n, a, b in zip(names, ours, theirs) if a != b],
            draft_layers=answer["draft_layers"], generate_s=held["generate_s"])
        entry["ok"] = entry["lossless"] and entry["acceptance_equal"] and entry["attention_read_alike"]
        result["exports"][name] = entry
    result["ok"] = result["target_only_equals_hf"] and all(e["ok"] for e in result["exports"].values())
    return result


def check(vllm_python: str, work: Path, broken: str | None = None, exports: list[str] | None = None,
          cases: list[str] | None = None) -> dict:
    """Every case of CASES (or of `cases`), each with its exports (or those of `exports` it has), against vLLM run
    by `vllm_python`: the findings of each case, `ok` for all."""
    result = {"break": broken, "cases": {}}
    for name in cases or list(CASES):
        case = CASES[name]
        chosen = [e for e in case.exports if exports is None or e in exports]
        if chosen:
            result["cases"][name] = check_case(case, vllm_python, work / name, broken, chosen)
    result["engine"] = next(iter(result["cases"].values()))["engine"] if result["cases"] else None
    result["ok"] = bool(result["cases"]) and all(c["ok"] for c in result["cases"].values())
    return result


def case_verdict(result: dict) -> list[str]:
    lines = [f"  {result['target']} ({result['prompts']} prompts x {result['max_tokens']} tokens, {result['dtype']}): "
             f"target-only vLLM = Hugging Face greedy: {'yes' if result['target_only_equals_hf'] else 'NO'}"]
    for name, e in result["exports"].items():
        if not e["served"]:
            expected = "expected" if e["expected"] else "UNEXPECTED"
            lines.append(f"    {name}: not served by vLLM's CPU build ({expected}): {e['error'][:160]}")
            continue
        alone = " (vLLM serving one request at a time)" if e.get("acceptance_from") == "alone" else ""
        lines.append(f"    {name}: outputs {'identical' if e['lossless'] else 'DIFFER'}, acceptance{alone} "
                     f"{'identical' if e['acceptance_equal'] else 'DIFFERS'} (tau ours {e['our_tau']:.3f}, vLLM "
                     f"{e['vllm_tau']:.3f}), attention keys {'read alike' if e['attention_read_alike'] else 'READ DIFFERENTLY'}")
        if alone:
            differ = len(e["batched_acceptance_mismatches"])
            lines.append(f"      batched: outputs {'identical' if e['batched_lossless'] else 'DIFFER'}, acceptance "
                         f"differs on {differ} of {result['prompts']} prompts (tau {e['batched_vllm_tau']:.3f}; "
                         f"reported, not judged)")
    return lines


def verdict(result: dict) -> str:
    engine = result["engine"] or {}
    lines = [f"vLLM check (vllm-cpu {engine.get('vllm-cpu', '?')}, transformers {engine.get('transformers', '?')}):"]
    for case in result["cases"].values():
        lines += case_verdict(case)
    lines.append(f"vLLM check: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM venv")
    parser.add_argument("--work", default=str(REPO / "build" / "engines" / "vllm"))
    parser.add_argument("--out", help="write the result JSON here")
    parser.add_argument("--case", action="append", choices=list(CASES), help="check this case only (repeatable)")
    parser.add_argument("--break", dest="broken", choices=["layer_ids"], help="a deliberate break the check must catch")
    args = parser.parse_args()
    result = check(args.vllm_python, Path(args.work), args.broken, cases=args.case)
    print(verdict(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
