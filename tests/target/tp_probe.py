"""Tensor-parallel features against the unsharded target's, in each process of a torchrun launch (gloo on a CPU).

    torchrun --nproc-per-node 2 -m tests.target.tp_probe tiny_qwen3 tiny_qwen3_5 ...   # rank 0 prints one JSON line

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


def probe(name: str) -> dict:
    from dataclasses import replace

    from dflash.errors import ConfigError
    from dflash.target.features import batched_features, target_forward, topk_of
    from dflash.target.loading import load_target
    from dflash.target.sharding import drain
    from tests.conftest import compose

    cfg = compose("extract", [f"target={name}"]).target
    whole = load_target(cfg, torch.device("cpu"))
    try:
        sharded = load_target(replace(cfg, tensor_parallel=2), torch.device("cpu"))
    except ConfigError as e:
        return {"refused": str(e)}
    rank = sharded.tp.index
    g = torch.Generator().manual_seed(rank)
    sequences = [torch.randint(0, 250, (n,), generator=g) for n in ([30, 17, 9] if rank == 0 else [12])]
    layers, worst, worst_top = [1, 3, 5], 0.0, 0.0
    for i, features, top in batched_features(sharded, sequences, layers, 64, topk=8):
        ref = target_forward(whole, sequences[i][None], layers, logits_to_keep=0)
        worst = max(worst, (features - ref.features[0]).abs().max().item())
        worst_top = max(worst_top, (top.logprobs - topk_of(ref.logits[0], 8).logprobs).abs().max().item())
    drain(sharded)
    return {"features": worst, "topk_logprobs": worst_top, "sharding": sharded.sharding,
            "parameters": held(sharded.model), "planned": planned(whole.model.config, 2)}


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


def main(names: list[str]) -> None:
    import torch.distributed as td

    td.init_process_group("gloo")
    out = {name: probe(name) for name in names}
    gathered = [None] * td.get_world_size()
    td.all_gather_object(gathered, out)
    if td.get_rank() == 0:
        print(json.dumps(gathered))


if __name__ == "__main__":
    main(sys.argv[1:])
