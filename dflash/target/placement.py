"""Whether the target fits a device beside what else a process keeps there, known before any weights are read.

Online training keeps the whole frozen target on every process's device, beside the drafter and its
optimizer state. The target's size follows from its config (parameter count, from a build on the meta
device, x the bytes of target.dtype) and the device reports its memory, so a target that cannot fit
stops the run up front, with the figures, rather than at an out-of-memory error after minutes of loading.
The figures are the persistent terms of dflash/plan/memory.py's memory plan; activations come on top (the plan
models the whole step).
"""

from __future__ import annotations

import torch

from dflash.errors import ConfigError
from dflash.target.sharding import sharded_parameters

GiB = 2**30
ALLOWANCE = 2 * GiB
"""The CUDA context, NCCL's buffers: dflash/plan/memory.py's allowance_gb."""


def parameter_count(hf_config, trust_remote_code: bool = False, tensor_parallel: int = 1) -> int:
    """Parameters of the causal LM that `load_target` builds from `hf_config` (tied weights once) that one process
    holds (a tensor-parallel group of `tensor_parallel` splits what transformers' plans split:
    dflash.target.sharding.sharded_parameters), counted on the meta device: nothing is allocated and no weights
    are read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    return sharded_parameters(model, tensor_parallel)


def device_memory(device: torch.device) -> int | None:
    """Total bytes of a CUDA device; None for any other device (a CPU run uses host memory, not checked)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def check_fits(device: torch.device, parts: dict[str, tuple[int, str]], why: str, fix: str) -> None:
    """Refuse when the bytes of `parts` ({name: (bytes, how they are made up)}) and the allowance exceed the
    device's memory; the message gives each part in GiB, the total, the device's GiB, `why` and `fix`."""
    memory = device_memory(device)
    need = sum(size for size, _ in parts.values()) + ALLOWANCE
    if memory is None or need <= memory:
        return
    figures = " + ".join(f"{name} {gib(size)} ({how})" for name, (size, how) in parts.items())
    raise ConfigError(f"{why}, and that does not fit {device}: {figures} + {gib(ALLOWANCE)} for the CUDA context "
                      f"and NCCL = {gib(need)}, more than the device's {gib(memory)}, before any activations. {fix}")


def gib(size: int) -> str:
    """Bytes in GiB, to a tenth (three significant digits below 1 GiB: a tiny model is not "0.0 GiB")."""
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / GiB:.3g} GiB"
