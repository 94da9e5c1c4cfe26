"""Online training's up-front check: does the target fit each process's device beside the drafter?

Online training (train.mode=online) keeps the frozen target on every process's device: whole, or its share of
a tensor-parallel group (target.tensor_parallel; the drafter borrows the target's embed_tokens and lm_head as
plain tensors either way). Qwen3.6-27B in bf16 is 50 GiB; beside a 1.8 B-parameter
drafter under DDP (34 GiB of float32 weights, gradients, AdamW moments and DDP's gradient buckets) that is
more than an 80 GB GPU holds before the first activation. The run stops here, before the target is loaded,
naming the figures and the ways out.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from dflash.config import JobConfig
from dflash.target import placement
from dflash.target.loading import DTYPES, Target, read_config

log = logging.getLogger(__name__)


def world_size() -> int:
    """Processes of this launch (the process group's, else the launcher's WORLD_SIZE)."""
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        return td.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def drafter_parameters(job: JobConfig, text_config) -> int | None:
    """The drafter's parameter count, from a build on the meta device (nothing allocated); None when
    drafter.init_from has no config.json (loading it later says what is missing)."""
    from dflash.drafter.build import build_drafter
    from dflash.drafter.model import DFlashDraftModel

    with torch.device("meta"):
        if job.drafter.init_from:
            folder = Path(job.drafter.init_from).expanduser()
            if not (folder / "config.json").exists():
                return None
            drafter = DFlashDraftModel(DFlashDraftModel.config_class.from_pretrained(str(folder)))
        else:
            H, V = text_config.hidden_size, text_config.vocab_size
            heads = Target(model=None, tokenizer=None, config=text_config, layers=None, final_norm=None,
                           embed_tokens=nn.Embedding(V, H), lm_head=nn.Linear(H, V, bias=False),
                           mask_token_id=job.target.mask_token_id, path=job.target.path)
            drafter = build_drafter(job.drafter, job.layers, heads)
    return sum(p.numel() for p in drafter.parameters())


def drafter_state(job: JobConfig, params: int, world: int) -> tuple[int, str]:
    """(bytes per process, what they are) of the drafter's training state, as bench/plan.py counts them:
    float32 weights, gradients and two AdamW moments; DDP adds its gradient buckets (world > 1); FSDP shards
    the four and gathers the weights in the compute dtype for each forward and backward."""
    if job.train.distributed == "fsdp" and world > 1:
        compute = 4 if job.train.mixed_precision == "no" else 2
        return params * 16 // world + params * compute, (f"{params / 1e9:.3f} B parameters: float32 weights, "
                                                         f"gradients, AdamW moments sharded {world} ways, and "
                                                         f"the gathered weights")
    buckets = job.train.distributed == "ddp" and world > 1
    return params * (20 if buckets else 16), (f"{params / 1e9:.3f} B parameters: float32 weights, gradients, "
                                              f"AdamW moments{', DDP gradient buckets' if buckets else ''}")


def check_online_fit(job: JobConfig, device: torch.device) -> None:
    """Refuse train.mode=online up front when the target (its share under target.tensor_parallel) and the drafter's
    state cannot share `device` (checked on CUDA devices only; reads config files, no weights)."""
    if placement.device_memory(device) is None:
        return
    _, _, hf_config = read_config(job.target)
    text = hf_config.get_text_config()
    dtype = DTYPES[job.target.dtype]
    tp = job.target.tensor_parallel
    target_params = placement.parameter_count(hf_config, job.target.trust_remote_code, tp)
    params = drafter_parameters(job, text)
    if params is None:
        return
    world = world_size()
    state = drafter_state(job, params, world)
    offline = ("train.mode=offline, training from a feature cache (extract.py or the run itself extracts the "
               "features once; training then keeps only the target's embed_tokens and lm_head on the device)")
    fixes = [offline, "a GPU with more memory (e.g. an H200's 141 GB)"]
    if job.train.distributed != "fsdp" and world > 1:
        fixes.append("train.distributed=fsdp, which shards the drafter's state")
    if tp < world:
        fixes.append(f"target.tensor_parallel={next((n for n in (2, 4, 8) if n > tp and world % n == 0), world)} "
                     f"(up to the processes of a node), which shards the target")
    target_bytes = target_params * dtype.itemsize
    target_how = (f"{target_params / 1e9:.2f} B parameters x {dtype.itemsize} bytes, {job.target.dtype}"
                  + (f", its share of {tp} tensor-parallel processes" if tp > 1 else ""))
    placement.check_fits(
        device, {f"target {job.target.name}": (target_bytes, target_how), "drafter and optimizer": state},
        why=(f"train.mode=online keeps the {'whole ' if tp == 1 else ''}target on every process's device beside the "
             f"drafter ({world} process{'es' if world > 1 else ''}, {job.train.distributed})"),
        fix=(f"Use {'; or '.join(fixes)}. `python -m bench.plan <your overrides> world_size={world}` gives the "
             f"whole step's memory"))
    log.info("online training: target %s (%s) and the drafter's state (%s) fit %s", job.target.name,
             placement.gib(target_bytes), placement.gib(state[0]), device)
