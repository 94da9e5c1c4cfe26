"""A target bigger than one device, behind the same features function: tensor parallel over processes
(target.tensor_parallel, transformers' own plan for the family) or its layers placed over one process's GPUs
(target.device_map, accelerate's big-model placement).

Under tensor parallelism the processes of a group (tensor_parallel consecutive ranks) hold one target between them,
and every forward is a collective of the group: each of its processes must run the same forward at the same time.
Everything else stays each process's own: it prepares, extracts and trains on its own share of the data, as an
unsharded process does. So the target's work is shared. A process that needs a forward (`shared`) gathers what each
process of its group needs at that moment; all of them run each of those calls, in the group's order, and each keeps
its own result. A process done with its share keeps serving the others (`drain`) until all of them are done. Every
call is computed once for the group, the same work as unsharded, and the features are the unsharded target's up to
float rounding (tests hold them within 1e-5 in float32 for the families of EXACT_FAMILIES).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash.errors import ConfigError
from dflash.target.identity import moe_experts

log = logging.getLogger(__name__)

EXACT_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "llama", "gpt_oss")
"""model_type (of the text config) of the families whose tensor-parallel features the tests hold equal to the
unsharded target's (tests/target/test_sharding.py): their features mix with unsharded ones."""

BROKEN_PLANS = {
    "gemma4_text": "the plan splits the projections of Gemma 4's full-attention layers (a head width of their own, "
                   "the keys shared as values) into shapes their forward cannot take (transformers 5.25)",
}
"""Families whose transformers plan exists but does not run, and why: refused like a family without a plan."""

PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")
"""target.device_map values: accelerate's placements of the layers over this process's GPUs."""


@dataclass
class TensorParallel:
    """This process's tensor-parallel group: `size` consecutive ranks, this one `index` among them."""

    group: object
    """The group's torch.distributed ProcessGroup."""
    size: int
    index: int

    def gather(self, obj) -> list:
        import torch.distributed as td

        out = [None] * self.size
        td.all_gather_object(out, obj, group=self.group)
        return out


def shared(target, fn, *args):
    """fn(target, *args) on this process, run by every process of its tensor-parallel group (each process's call
    in turn, in the group's order), each keeping its own result; without tensor parallelism just the call.
    fn: a module-level function (it travels by name); args: plain values and CPU tensors."""
    tp = getattr(target, "tp", None)  # stand-ins of a target (tests, plain HF models through as_target) have none
    if tp is None:
        return fn(target, *args)
    mine = None
    for i, call in enumerate(tp.gather((fn, args))):
        if call is not None:
            out = call[0](target, *call[1])
            if i == tp.index:
                mine = out
    return mine


def drain(target) -> None:
    """Serve the other processes of this tensor-parallel group (`shared`) until every one of them is done too:
    called once a process has no more forwards of its own (its share of the shards or prompts is smaller)."""
    tp = getattr(target, "tp", None)
    if tp is None:
        return
    while True:
        calls = tp.gather(None)
        if all(call is None for call in calls):
            return
        for call in calls:
            if call is not None:
                call[0](target, *call[1])


def check_shardable(name: str, text_config, size: int) -> None:
    """Refuse, in one line, a tensor-parallel size transformers' plan for this family cannot split evenly, or a
    family with no plan at all."""
    family = getattr(text_config, "model_type", "?")
    plan = getattr(text_config, "base_model_tp_plan", None)
    if not plan or family in BROKEN_PLANS:
        why = BROKEN_PLANS.get(family, "transformers has no tensor-parallel plan for it")
        raise ConfigError(f"target.tensor_parallel={size} cannot shard {name} ({family}): {why}; place its layers "
                          f"over this process's GPUs instead (target.device_map=auto)")
    counts = {k: _value(text_config, k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                                                   "linear_num_key_heads", "linear_num_value_heads")}
    uneven = {k: v for k, v in counts.items() if isinstance(v, int) and v % size}
    if uneven:
        what = ", ".join(f"{k}={v}" for k, v in uneven.items())
        raise ConfigError(f"target.tensor_parallel={size} does not divide {name}'s {what}; use a size that divides "
                          f"them (1, 2, 4, ...), or place the layers instead (target.device_map=auto)")


def _value(config, key: str):
    """A config value, or None where the config has none or keeps it per layer (Gemma 4 refuses the global read of
    a per-layer attribute: its layers are then checked by transformers' own plan when it splits them)."""
    try:
        return getattr(config, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def tensor_parallel_group(size: int) -> TensorParallel:
    """This process's group of `size` consecutive ranks (the inner dimension of transformers' mesh), after
    checking that the processes were started together and their number is a multiple of `size`."""
    import torch.distributed as td

    if not (td.is_available() and td.is_initialized()):
        raise ConfigError(f"target.tensor_parallel={size} shards the target over {size} processes started together: "
                          f"launch with torchrun --nproc-per-node {size} (or accelerate launch --num_processes "
                          f"{size}) ..., or set target.tensor_parallel=1")
    world = td.get_world_size()
    if world % size:
        raise ConfigError(f"target.tensor_parallel={size} does not divide the {world} processes of this launch; "
                          f"launch a multiple of {size}")
    group, _ = td.new_subgroups(group_size=size)
    return TensorParallel(group=group, size=size, index=td.get_rank() % size)


def expert_parallel(text_config) -> bool:
    """Whether sharding splits the target's experts too: an MoE family with transformers' expert-parallel plan
    (its experts then go to the group's processes, ep_size = tensor_parallel; without it every process would hold
    all of them, which is most of an MoE target's weights)."""
    return bool(getattr(text_config, "base_model_ep_plan", None)) and bool(moe_experts(text_config)[0])


def load_sharded(path: str, name: str, text_config, size: int, dtype: torch.dtype, attn_implementation: str,
                 common: dict) -> tuple[torch.nn.Module, TensorParallel, dict]:
    """(the causal LM under transformers' tensor-parallel plan over groups of `size` processes, this process's
    group, the sharding as manifests record it). Every group is one replica: a mesh of world / size replicas x
    size shards; an MoE target's experts are split over the group too (`expert_parallel`). Each process reads only
    its shards' weights."""
    import torch.distributed as td
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    check_shardable(name, text_config, size)
    tp = tensor_parallel_group(size)
    replicas = td.get_world_size() // size
    experts = expert_parallel(text_config)
    parallel = DistributedConfig(tp_size=size, tp_plan="auto",
                                 **({"enable_expert_parallel": True, "ep_size": size} if experts else {}),
                                 **({"dp_replicate_size": replicas} if replicas > 1 else {}))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 distributed_config=parallel, use_kernels=False, **common)
    log.info("target %s: tensor parallel over %d processes%s, %d replica(s)", name, size,
             " (experts too)" if experts else "", replicas)
    return model, tp, {"tensor_parallel": size, "expert_parallel": size if experts else 1, "device_map": None}


def sharded_parameters(model, size: int) -> int:
    """Parameters one process of a tensor-parallel group of `size` holds (`load_sharded`'s layout): those of the
    modules transformers' plans split (the tensor-parallel plan, and the expert-parallel one where
    `expert_parallel`), 1/size each; the rest whole. model: the causal LM, built on the meta device is enough."""
    import re

    text = model.config.get_text_config()
    plans = {**(getattr(text, "base_model_tp_plan", None) or {}), **(getattr(model, "_tp_plan", None) or {})}
    if expert_parallel(text):
        plans.update(getattr(text, "base_model_ep_plan", None) or {})
    split = [re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + r"(\.|$)")
             for key, style in plans.items() if not style.startswith("replicated")]
    seen, total = set(), 0
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel() // size if any(r.search(name) for r in split) else param.numel()
    return total


def full_copy(module: torch.nn.Module) -> torch.nn.Module:
    """An embedding or head whose weight a tensor-parallel plan split (a DTensor), as a plain module holding the
    whole weight: what the drafter borrows (it runs unsharded, on every process). Unsplit ones as they are."""
    from torch.distributed.tensor import DTensor

    weight = module.weight
    if not isinstance(weight, DTensor):
        return module
    full = weight.full_tensor().detach()
    if isinstance(module, torch.nn.Embedding):
        return torch.nn.Embedding.from_pretrained(full, freeze=True)
    head = torch.nn.Linear(full.shape[1], full.shape[0], bias=False, dtype=full.dtype, device=full.device)
    head.weight = torch.nn.Parameter(full, requires_grad=False)
    return head
