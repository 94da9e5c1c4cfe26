"""Tensor-parallel features against the unsharded target's, in each process of a torchrun launch (gloo on a CPU).

    torchrun --nproc-per-node 2 -m tests.target.tp_probe tiny_qwen3 tiny_qwen3_5 ...   # rank 0 prints one JSON line
    torchrun --nproc-per-node N -m tests.target.tp_probe --device cuda tiny_qwen3 ...  # N GPUs, TP = N (NCCL)
    python -m tests.target.tp_probe --device cuda --placement tiny_qwen3 ...           # target.device_map=auto

Per target: the features of a few sequences through `batched_features` (what extraction runs) on the target loaded
with target.tensor_parallel=2, the processes' shares of unequal size (process 0 has three sequences, process 1 one,
so process 1 drains while process 0 still extracts), each against the same target loaded whole in the same process;
the largest absolute difference of any feature and of any top-k log-probability; and the parameters the process holds
against the plan's count of them. A target whose sharding is refused reports the one-line reason.
"""

from __future__ import annotations

import json
import sys

import torch


def probe(name: str, device: torch.device, size: int, placement: bool = False) -> dict:
    """One target's comparison (module docstring): sharded over `size` processes, or placed (target.device_map)."""
    from dataclasses import replace

    from dflash.errors import ConfigError
    from dflash.target.features import batched_features, target_forward, topk_of
    from dflash.target.loading import load_target
    from dflash.target.sharding import drain
    from tests.conftest import compose

    # on CUDA a hybrid target runs fla where it is installed; without it both loads run the same fallback
    cfg = replace(compose("extract", [f"target={name}"]).target, allow_fallback_kernels=True)
    whole = load_target(cfg, device)
    try:
        layout = {"device_map": "auto"} if placement else {"tensor_parallel": size}
        sharded = load_target(replace(cfg, **layout), device)
    except ConfigError as e:
        return {"refused": str(e)}
    rank = sharded.tp.index if sharded.tp is not None else 0
    g = torch.Generator().manual_seed(rank)
    sequences = [torch.randint(0, 250, (n,), generator=g) for n in ([30, 17, 9] if rank == 0 else [12])]
    layers, worst, worst_top = [1, 3, 5], 0.0, 0.0
    for i, features, top in batched_features(sharded, sequences, layers, 64, topk=8):
        ref = target_forward(whole, sequences[i][None].to(whole.device), layers, logits_to_keep=0)
        worst = max(worst, (features - ref.features[0]).abs().max().item())
        worst_top = max(worst_top, (top.logprobs - topk_of(ref.logits[0], 8).logprobs).abs().max().item())
    drain(sharded)
    return {"features": worst, "topk_logprobs": worst_top, "sharding": sharded.sharding,
            "parameters": held(sharded.model), "planned": planned(whole.model.config, 1 if placement else size)}


def held(model) -> int:
    """Parameters this process holds of a sharded model: each tensor's local shard, tied ones once."""
    from torch.distributed.tensor import DTensor

    seen = {id(p): p for p in model.parameters()}.values()
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in seen)


def planned(config, size: int) -> int:
    """What dflash.target.sharding.sharded_parameters (the plan's count) says a process of `size` holds."""
    from transformers import AutoModelForCausalLM

    from dflash.target.sharding import sharded_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sharded_parameters(model, size)


def main(argv: list[str]) -> None:
    import argparse
    import os

    import torch.distributed as td

    parser = argparse.ArgumentParser(prog="python -m tests.target.tp_probe")
    parser.add_argument("names", nargs="+")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--placement", action="store_true", help="one process, target.device_map=auto")
    args = parser.parse_args(argv)
    if args.placement:
        print(json.dumps([{name: probe(name, torch.device(args.device), 1, True) for name in args.names}]))
        return
    td.init_process_group("nccl" if args.device == "cuda" else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = {name: probe(name, device, td.get_world_size()) for name in args.names}
    gathered = [None] * td.get_world_size()
    td.all_gather_object(gathered, out)
    if td.get_rank() == 0:
        print(json.dumps(gathered))
    td.barrier()
    td.destroy_process_group()  # left to the interpreter's exit, gloo's threads sometimes abort the process


if __name__ == "__main__":
    main(sys.argv[1:])
