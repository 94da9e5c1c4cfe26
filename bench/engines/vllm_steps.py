"""A speculative engine step and its forward passes, timed inside vLLM (its CPU build); run in the vLLM venv.

    python bench/engines/vllm_steps.py request.json answer.json

The micro-benchmark of the serving cost model (dflash/plan/serving.py): vLLM loads the target with the drafter as
`vllm serve` does (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0, so that a step is one call) and times, at
each concurrency C of the request:
- target_decode: the target's forward over C requests x 1 token (a step without speculation), by its model runner;
- target_verify: the target over C requests x (k + 1) tokens (a verify step: the last token and k drafts);
- drafter: the drafter over C x (k + 1) query tokens and as many context states (vLLM's DFlash proposer);
- step: a whole engine step with C requests decoding and none arriving (scheduler, the forwards, and with a drafter
  rejection sampling and the drafter's inputs), the median over the steps where all C are in flight;
- admission: what a step that admits one more request costs over one that admits none (its prefill, and the
  drafter's pass over its prompt), the median of 9.
With "drafter": null the target alone (step and admission only).
request.json: target, drafter, num_speculative_tokens, concurrency (a list), dtype, max_model_len, repeats,
prompts (user messages, templated by the target's tokenizer as `vllm bench serve` does), max_tokens, temperatures
and spec_extra (more keys of the speculative config). answer.json: {"versions", "seconds": {forward: {C: median
seconds}}, "step": {T: {C: median seconds}}, "step_tokens": {T: {C: tokens kept per request per step}},
"admission": {C: seconds}}, or {"error"}. Imports vLLM, vllm_cli.py and the standard library only.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


def time_forwards(worker, concurrency: list[int], k: int, repeats: int) -> dict:
    """Median seconds of each forward kind at each C, on `worker` (called in vLLM's worker process)."""
    runner = worker.model_runner

    def median(fn) -> float:
        fn()  # warm: first calls allocate
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out: dict[str, dict[int, float]] = {"target_decode": {}, "target_verify": {}, "drafter": {}}
    for c in concurrency:
        out["target_decode"][c] = median(lambda: runner._dummy_run(c, force_attention=True))
        out["target_verify"][c] = median(lambda: runner._dummy_run(c * (k + 1), uniform_decode=True,
                                                                     force_attention=True))
        out["drafter"][c] = median(lambda: runner.drafter.dummy_run(c * (k + 1), use_cudagraphs=False))
    return out


def templated(llm, prompts: list[str], i: int) -> str:
    """Prompt i (cycling) as `vllm bench serve` sends it: one user message in the target's chat template."""
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                                   add_generation_prompt=True, tokenize=False)


def engine_steps(llm, prompts: list[str], c: int, max_tokens: int, temperature: float,
                 rounds: int = 3) -> tuple[float, float]:
    """(median seconds of an engine step while all c requests decode, tokens kept per request per such step), over
    `rounds` batches of c requests, each batch starting at the next prompts."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    times, kept = [], 0
    for r in range(rounds):
        for i in range(c):
            engine.add_request(f"c{c}-{r}-{i}", templated(llm, prompts, r * c + i), params)
        made: dict[str, int] = {}
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            took = time.perf_counter() - start
            before = dict(made)
            made.update({o.request_id: len(o.outputs[0].token_ids) for o in outs})
            # a decode step of all c: every request had its first token before it and none finished in it
            if len(before) == c and len(outs) == c and not any(o.finished for o in outs):
                times.append(took)
                kept += sum(made[q] - before[q] for q in made)
    if not times:
        raise RuntimeError(f"no engine step had all {c} requests decoding; raise max_tokens")
    return statistics.median(times), kept / (len(times) * c)


def admission_cost(llm, prompts: list[str], c: int, rounds: int = 9) -> float:
    """Median extra seconds of an engine step that admits one request (its prefill, and with a drafter the drafter's
    pass over its prompt) while c requests decode, over a step that admits none."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    ids = [f"adm{c}-{i}" for i in range(c)]
    for i, r in enumerate(ids):
        engine.add_request(r, templated(llm, prompts, i), long)
    for _ in range(2):  # their prefill, and a first decode step
        engine.step()
    extra = []
    for j in range(rounds):
        start = time.perf_counter()
        engine.step()
        clean = time.perf_counter() - start
        engine.add_request(f"adm{c}-x{j}", templated(llm, prompts, j + 1), SamplingParams(temperature=0.0, max_tokens=400))
        start = time.perf_counter()
        engine.step()
        extra.append(time.perf_counter() - start - clean)
        engine.abort_request([f"adm{c}-x{j}"])
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return max(0.0, statistics.median(extra))


def main() -> None:
    import vllm_cli  # beside this file: vLLM's code asks for the "vllm" version, which the CPU wheel lacks

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc pickles time_forwards
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: step() is one step
    request = json.loads(open(sys.argv[1]).read())
    answer = {"versions": {d: vllm_cli.version(d) for d in ("vllm", "torch", "transformers")}}
    try:
        from vllm import LLM

        k = request["num_speculative_tokens"] if request["drafter"] else 0
        top = max(request["concurrency"])
        spec = {"method": "dflash", "model": request["drafter"], "num_speculative_tokens": k,
                **request.get("spec_extra", {})} if request["drafter"] else None
        llm = LLM(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                  enforce_eager=True, seed=0, gpu_memory_utilization=0.15, max_num_seqs=max(top, 8),
                  max_num_batched_tokens=max(top * (k + 1), 2048), speculative_config=spec)
        answer["step"], answer["step_tokens"] = {}, {}
        for t in request["temperatures"]:
            steps = [engine_steps(llm, request["prompts"], c, request["max_tokens"], t) for c in request["concurrency"]]
            answer["step"][f"{t:g}"] = {c: s for c, (s, _) in zip(request["concurrency"], steps)}
            answer["step_tokens"][f"{t:g}"] = {c: n for c, (_, n) in zip(request["concurrency"], steps)}
        answer["admission"] = {c: admission_cost(llm, request["prompts"], c) for c in request["concurrency"]}
        if spec:  # after the engine steps, which warm the engine (forwards timed first ran 50x slower at small C)
            answer["seconds"] = llm.collective_rpc(time_forwards, args=(request["concurrency"], k,
                                                                         request.get("repeats", 20)))[0]
    except Exception as e:  # the caller says in one line why there are no timings
        answer["error"] = f"{type(e).__name__}: {e}"
        answer["traceback"] = traceback.format_exc()[-4000:]
    with open(sys.argv[2], "w") as f:
        json.dump(answer, f, indent=1)
    sys.exit(0 if "error" not in answer else 3)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
