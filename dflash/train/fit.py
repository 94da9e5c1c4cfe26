"""Training's up-front checks, before the target is loaded: does a step fit each process's device?

Online training (train.mode=online) keeps the frozen target on every process's device: whole, or its share of
a tensor-parallel group (target.tensor_parallel; the drafter borrows the target's embed_tokens and lm_head as
plain tensors either way). Qwen3.6-27B in bf16 is 50 GiB; beside a 1.8 B-parameter
drafter under DDP (34 GiB of float32 weights, gradients, AdamW moments and DDP's gradient buckets) that is
more than an 80 GB GPU holds before the first activation (`check_online_fit`). Then the whole step at
data.max_length, by the memory plan's peak (dflash.plan.memory, what `python -m dflash.plan` prints): activations
grow with the length, and a 32k-token step can be 10 GiB more than a 3k one (`check_length_fit`). Each run stops
here naming the figures and the ways out. train.gradient_checkpointing=auto is decided here too, by the same plan
(`resolve_checkpointing`, once as training starts; the mode is passed down and recorded in run.json, the job is
never written).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dflash.config import JobConfig, TrainConfig
from dflash.drafter.build import build_drafter
from dflash.drafter.model import DFlashDraftModel
from dflash.errors import ConfigError
from dflash.target import placement
from dflash.target.loading import DTYPES, Target, read_config
from dflash.plan import configured, memory

log = logging.getLogger(__name__)


def world_size() -> int:
    """Processes of this launch (the process group's, else the launcher's WORLD_SIZE)."""
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        return td.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def meta_drafter(job: JobConfig, text_config):
    """The configured drafter built on the meta device (nothing allocated); None when drafter.init_from has no
    config.json (loading it later says what is missing)."""

    with torch.device("meta"):
        if job.drafter.init_from:
            folder = Path(job.drafter.init_from).expanduser()
            if not (folder / "config.json").exists():
                return None
            return DFlashDraftModel(DFlashDraftModel.config_class.from_pretrained(str(folder)))
        H, V = text_config.hidden_size, text_config.vocab_size
        heads = Target(model=None, tokenizer=None, config=text_config, layers=None, final_norm=None,
                       embed_tokens=nn.Embedding(V, H), lm_head=nn.Linear(H, V, bias=False),
                       mask_token_id=job.target.mask_token_id, path=job.target.path)
        return build_drafter(job.drafter, job.layers, heads)


def drafter_parameters(job: JobConfig, text_config) -> int | None:
    """The drafter's parameter count (`meta_drafter`), None without a config.json to build it from."""
    drafter = meta_drafter(job, text_config)
    return None if drafter is None else sum(p.numel() for p in drafter.parameters())


def drafter_state(train: TrainConfig, params: int, world: int) -> tuple[int, str]:
    """(bytes per process, what they are) of the drafter's training state, as dflash/plan/memory.py counts them:
    float32 weights, gradients and two AdamW moments; DDP adds its gradient buckets (world > 1); FSDP shards
    the four and gathers the weights in the compute dtype for each forward and backward."""
    if train.distributed == "fsdp" and world > 1:
        compute = 4 if train.mixed_precision == "no" else 2
        return params * 16 // world + params * compute, (f"{params / 1e9:.3f} B parameters: float32 weights, "
                                                         f"gradients, AdamW moments sharded {world} ways, and "
                                                         f"the gathered weights")
    buckets = train.distributed == "ddp" and world > 1
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
    state = drafter_state(job.train, params, world)
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
        fix=(f"Use {'; or '.join(fixes)}. `python -m dflash.plan <your overrides> world_size={world}` gives the "
             f"whole step's memory"))
    log.info("online training: target %s (%s) and the drafter's state (%s) fit %s", job.target.name,
             placement.gib(target_bytes), placement.gib(state[0]), device)


def planned_step(job: JobConfig):
    """(Shape, Setup) of the configured step on one of this launch's processes (dflash.plan.memory, as the plan
    builds them), or None when the drafter cannot be built yet (drafter.init_from without config.json). Reads
    config files, no weights."""
    _, _, hf_config = read_config(job.target)
    text = hf_config.get_text_config()
    drafter = meta_drafter(job, text)
    if drafter is None:
        return None
    online = {}
    if job.train.mode == "online":
        online = {"target_params": placement.parameter_count(hf_config, job.target.trust_remote_code,
                                                             job.target.tensor_parallel),
                  "target_intermediate": configured.active_intermediate(text),
                  "target_window": configured.sliding_window(text)}
    shape = configured.shape_of(drafter, text.vocab_size, bool(getattr(text, "tie_word_embeddings", False)), **online)
    return shape, configured.setup_of(job.target, job.train, job.loss, job.noise, job.data.max_length, world_size(),
                                  optim=job.optim)


def step_plan(job: JobConfig, device: torch.device) -> tuple:
    """(`device`'s memory in bytes or None where it is not a CUDA device, `planned_step` or None): what
    resolve_checkpointing and check_length_fit judge, built once for both (it builds the drafter on meta)."""
    budget = placement.device_memory(device)
    return budget, (None if budget is None else planned_step(job))


def resolve_checkpointing(job: JobConfig, device: torch.device, plan: tuple | None = None) -> str:
    """The gradient checkpointing mode training runs with on `device` (off, selective or full): the configured one,
    or for train.gradient_checkpointing=auto the plan's choice (memory.choose_checkpointing: off where the planned step
    fits without, else selective where that fits, else full; off on CPU, or when the drafter cannot be planned
    before loading), with one line saying which and why. job is not changed. plan: `step_plan`'s."""
    if job.train.gradient_checkpointing != "auto":
        return job.train.gradient_checkpointing
    budget, planned = plan or step_plan(job, device)
    if budget is not None and planned is None:
        mode, why = False, "off (drafter.init_from has no config.json yet: the step cannot be planned)"
    else:
        mode, why = memory.choose_checkpointing(*(planned or (None, None)), budget)
    log.info("train.gradient_checkpointing=auto on %s: %s", device, why)
    return memory.MODE_WORDS[mode]


def check_length_fit(job: JobConfig, device: torch.device, checkpointing: str, plan: tuple | None = None) -> None:
    """Refuse a data.max_length whose step the memory plan says does not fit `device` (CUDA devices only), in one
    line: the planned peak, the device's memory and the fixes with their figures (the longest data.max_length and
    the most train.num_anchors that fit, gradient checkpointing, FSDP). checkpointing: the resolved mode (off,
    selective or full: `resolve_checkpointing`'s) the step is judged with; plan: `step_plan`'s."""
    budget, planned = plan or step_plan(job, device)
    if planned is None:
        return
    shape, setup = planned
    setup = replace(setup, checkpointing=configured.checkpointing_of(checkpointing))
    need, phase = memory.peak(shape, setup)
    if need <= budget:
        return
    # the longest multiple of 256 tokens that fits (the peak grows with the length): lo fits, hi does not
    fits = lambda k: memory.peak(shape, replace(setup, ctx_len=256 * k))[0] <= budget  # noqa: E731
    lo, hi = 0, -(-setup.ctx_len // 256)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    anchors = memory.max_anchors(shape, setup, budget)
    fixes = [f"data.max_length={256 * lo} (the longest that fits)" if lo else "a lower data.max_length",
             *([f"train.num_anchors={anchors} (the most that fit)"] if anchors else [])]
    if not setup.checkpointing:
        fixes.append(f"train.gradient_checkpointing=selective (peak "
                     f"{gib_at(shape, setup, checkpointing='selective')})")
    if setup.checkpointing is not True:
        fixes.append(f"train.gradient_checkpointing=full (peak {gib_at(shape, setup, checkpointing=True)})")
    if not setup.sharded and setup.world > 1:
        fixes.append(f"train.distributed=fsdp (peak {gib_at(shape, setup, distributed='fsdp')})")
    raise ConfigError(f"data.max_length={setup.ctx_len}: a training step of that length is planned to peak at "
                      f"{placement.gib(need)} a process (at {phase}; `python -m dflash.plan` gives every term), more "
                      f"than {device}'s {placement.gib(budget)}; set {', or '.join(fixes)}")


def gib_at(shape, setup, **change) -> str:
    """The planned peak, in GiB, of `setup` with `change` (dataclasses.replace's keywords)."""
    return placement.gib(memory.peak(shape, replace(setup, **change))[0])
