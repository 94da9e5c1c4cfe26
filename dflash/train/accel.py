"""accelerate set-up: DDP, or FSDP2 on CUDA, and the drafter's full weights gathered from either.

The loop calls these; what differs between DDP and FSDP lives here (the loop's `Model.model` is the
wrapped module, `Model.drafter` the same module's parameters, sharded under FSDP).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch

from dflash.config import TrainConfig
from dflash.drafter.model import DFlashDraftModel
from dflash.errors import ConfigError

log = logging.getLogger(__name__)


def make_accelerator(train: TrainConfig):
    """The Accelerator: DDP, or FSDP (train.distributed=fsdp, CUDA only); the schedule is stepped by the loop,
    once per optimizer step."""
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    if train.distributed == "fsdp" and not cuda:
        raise ConfigError(f"train.distributed=fsdp needs CUDA devices: accelerate {accelerate.__version__} runs FSDP "
                          f"on accelerators only (on a CPU it silently trains DDP instead) and torch's FSDP1 needs an "
                          f"accelerator device; use train.distributed=ddp here")
    precision = train.mixed_precision
    precision = ("bf16" if cuda else "no") if precision == "auto" else precision
    plugin = None
    if train.distributed == "fsdp":
        # what `accelerate launch --fsdp_state_dict_type FULL_STATE_DICT` sets: a gloo group next to NCCL for
        # gathering the full state on the CPU
        os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"
        plugin = fsdp_plugin()
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # not eight INFO lines per checkpoint
    # the process group's timeout, for collectives and short barriers (long waits go through dflash.dist.wait_long).
    # accelerate passes on only what differs from its default of 10 min: exactly 10 would leave torch's default
    # of 30 min for gloo and FSDP's nccl+gloo group, so a microsecond more is passed on
    minutes = train.collective_timeout_minutes
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=minutes, microseconds=1 if minutes == 10 else 0))
    acc = Accelerator(mixed_precision=precision, fsdp_plugin=plugin, cpu=not cuda, step_scheduler_with_optimizer=False,
                      kwargs_handlers=[timeout])
    if plugin is not None and not is_fsdp(acc):
        log.warning("train.distributed=fsdp on one process: accelerate trains it unsharded, as DDP would, and its "
                    "checkpoints are DDP's; launch several processes (accelerate launch --num_processes N) to shard")
    return acc


def fsdp_plugin():
    """FSDP2, each decoder layer its own shard group (the drafter's _no_split_modules). Parameters and gradient
    reductions stay float32 (autocast does the bf16 compute, as under DDP, so both train the same numbers).
    Checkpoints hold full state dicts, gathered on the main process: they load with weights_only (DCP's
    sharded format unpickles its metadata) and on any number of processes."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          state_dict_type="FULL_STATE_DICT",
                                          mixed_precision_policy=MixedPrecisionPolicy())


def is_fsdp(acc) -> bool:
    """Whether accelerate actually shards (train.distributed=fsdp on one process does not)."""
    from accelerate.utils import DistributedType

    return acc.distributed_type == DistributedType.FSDP


def full_drafter(acc, m):
    """The drafter with all its parameters, on the main process: the drafter itself under DDP (every process
    holds them all); under FSDP a plain copy that the shards are gathered into (every process must call this:
    the gathering is a collective). None on the other processes under FSDP."""
    if not is_fsdp(acc):
        return m.drafter
    weights = full_state_dict(acc, m)
    if not acc.is_main_process:
        return None
    with torch.device(acc.device):
        drafter = DFlashDraftModel(m.drafter.config).float()
    drafter.load_state_dict(weights)
    return drafter


def full_state_dict(acc, m) -> dict:
    """The drafter's weights under their z-lab names (without DDP/FSDP wrappers and torch.compile's prefix), on
    the main process; a collective under FSDP (the others get {})."""
    return {k.replace("_orig_mod.", ""): v for k, v in acc.get_state_dict(m.model).items()}
