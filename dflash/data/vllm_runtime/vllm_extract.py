"""Target hidden states through vLLM's `extract_hidden_states` method, shard by shard; run in the vLLM venv.

    python dflash/data/vllm_runtime/vllm_extract.py request.json

dflash.data.vllm_features (features.source=vllm) writes the request and runs this in the vLLM venv, which has no
dflash: it imports vLLM, torch, safetensors, vllm_pins.py and the standard library only. request.json: target, dtype,
vllm_layer_ids (vLLM's numbering: id l is the input of decoder layer l, i.e. the output of layer l - 1),
tensor_parallel, expert_parallel, max_model_len, engine_args (more keyword arguments of vllm.LLM), work (a
folder) and shards: for each k, <work>/in-<k>.safetensors holds input_ids [T] and offsets [n + 1]. For each shard
in order it writes <work>/out-<k>.safetensors (hidden_states [T, layers, H] in the engine's dtype, input_ids,
offsets) and prints `dflash-vllm shard <k>` (`dflash-vllm ready` once the engine is up), so that the caller
stores a shard while the next one runs.
<work>/engine.json says what ran: versions, device, the attention backend of each kind of layer, the connector,
seconds to load and to extract, or the error that stopped vLLM.

Every sequence is one prompt of one generated token: the connector stores the prompt's hidden states when the
request finishes. Chunked prefill and prefix caching are off: a prompt is computed whole, never taken in part
from an earlier prompt's cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version

READY, SHARD = "dflash-vllm ready", "dflash-vllm shard"  # what dflash.data.vllm_features waits for


def attention_backends(worker) -> dict:
    """{layer class: attention backend} of the target's layers as this worker built them."""
    found = {}
    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        kind = type(layer).__name__
        if kind != "CacheOnlyAttentionLayer" and hasattr(layer, "get_attn_backend"):
            found[kind] = layer.get_attn_backend().get_name()
    return found


def engine(request: dict, storage: str, cpu: bool):
    from vllm import LLM

    connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": storage}}
    if cpu:  # the stock connector's copy needs CUDA (vllm_hidden_states.py says what fails)
        import vllm_hidden_states

        vllm_hidden_states.check()
        connector.update(kv_connector=vllm_hidden_states.CONNECTOR, kv_connector_module_path="vllm_hidden_states")
    # engine_args may change the defaults (eager, memory, batch size), never what extraction rests on (after them)
    args = {"enforce_eager": True, "seed": 0, "max_num_batched_tokens": request["max_model_len"],
            # on a CPU, the share of the machine's memory vLLM asks to find free (0.92 by default); the cache of
            # hidden states is VLLM_CPU_KVCACHE_SPACE GiB (main() sets 1 unless it is set)
            **({"gpu_memory_utilization": 0.15} if cpu else {}), **request["engine_args"]}
    return LLM(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
               enable_chunked_prefill=False, enable_prefix_caching=False,
               tensor_parallel_size=request["tensor_parallel"], enable_expert_parallel=request["expert_parallel"],
               kv_transfer_config=connector,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": request["vllm_layer_ids"]}}},
               **args)


def extract_shard(llm, path_in: str, path_out: str) -> int:
    """One shard's hidden states into path_out; the number of tokens."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states, load_hidden_states)
    from vllm.inputs import TokensPrompt

    shard = load_file(path_in)
    ids, offsets = shard["input_ids"], shard["offsets"].tolist()
    prompts = [ids[s:e].tolist() for s, e in zip(offsets[:-1], offsets[1:])]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    rows = []
    for prompt, out in zip(prompts, outs):
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"vLLM returned no hidden_states_path for request {out.request_id}")
        got = load_hidden_states(path)  # waits for the connector's write (a lock on the file)
        cleanup_hidden_states(path)
        if got["token_ids"].tolist() != prompt:
            raise RuntimeError(f"request {out.request_id}: the connector stored other tokens than the prompt's")
        rows.append(got["hidden_states"])
    save_file({"hidden_states": torch.cat(rows).contiguous(), "input_ids": ids, "offsets": shard["offsets"]},
              path_out)
    return ids.numel()


def cpu_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each of `workers` CPU workers its share of this process's cores: vLLM
    binds one NUMA node per worker by default and stops where there are fewer ("Not enough allowed NUMA nodes to
    bind threads of 2 local CPUWorkers")."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // workers
    if share == 0:
        raise SystemExit(f"features.vllm.tensor_parallel={workers} CPU workers need a core each; {len(cores)} here")
    return "|".join(",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(workers))


def versions() -> dict:
    """vLLM's (its CPU build's distribution is vllm-cpu, the import vllm), and the libraries it ran with."""
    import vllm

    out = {"vllm": vllm.__version__}
    for dist in ("vllm-cpu", "torch", "transformers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def write_json_whole(path: str, obj: dict) -> None:
    """obj as JSON into path through a temporary file and a rename: the caller reads the report when it sees READY,
    and the final report is written while it may still be reading that one (a file opened for writing is empty
    until written: the caller read '' under load)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    work = request["work"]
    if os.environ.get("DFLASH_ENGINES_BREAK") == "layer_ids":  # vllm_features_check --break: must then FAIL
        request["vllm_layer_ids"] = [i - 1 for i in request["vllm_layer_ids"]]
    report = {"vllm_layer_ids": request["vllm_layer_ids"]}

    def write_report():
        write_json_whole(os.path.join(work, "engine.json"), report)

    try:
        report["versions"] = versions()
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if cpu:
            import vllm_pins  # beside this file (on PYTHONPATH)

            vllm_pins.check()
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; its default reserves a share of the memory
            if request["tensor_parallel"] > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(request["tensor_parallel"])
        # collective_rpc sends attention_backends to the workers by pickle, which vLLM allows only when told to
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        t0 = time.perf_counter()
        llm = engine(request, os.path.join(work, "hidden_states"), cpu)
        report.update(load_s=time.perf_counter() - t0, device="cpu" if cpu else current_platform.get_device_name(),
                      attention=llm.collective_rpc(attention_backends)[0],
                      connector="CPUHiddenStatesConnector (dflash/data/vllm_runtime/vllm_hidden_states.py)" if cpu
                      else "ExampleHiddenStatesConnector")
        write_report()
        print(READY, flush=True)
        t0, tokens = time.perf_counter(), 0
        for k in request["shards"]:
            tokens += extract_shard(llm, os.path.join(work, f"in-{k}.safetensors"),
                                    os.path.join(work, f"out-{k}.safetensors"))
            print(f"{SHARD} {k}", flush=True)
        report.update(extract_s=time.perf_counter() - t0, tokens=tokens)
    except (Exception, SystemExit) as e:  # the caller says why vLLM did not extract, in one line
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-4000:]
    write_report()
    sys.exit(3 if "error" in report else 0)


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which re-import this file
    main()
