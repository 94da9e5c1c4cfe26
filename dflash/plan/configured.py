"""A configured run as the plan's pure models take it (plain shapes and values): the Shape of a drafter and its
target's text config (MoE experts, the MLP width a token runs through, the sliding window), the Setup of the config
groups, the target's text config (`target_config`), the prompts the configured data holds, a sequence's FLOPs, the
measured MFU (`mfu_of`) and a tau the serving section is given (`read_tau`). What reads a configured run sits here,
above drafter/, so that memory, flops, costs and serving import nothing of the pipeline."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
import yaml

from dflash.config.plan import PlanConfig
from dflash.data.prompts import read_records
from dflash.drafter.blocks import pack_blocks
from dflash.errors import ConfigError, DFlashError
from dflash.plan import costs
from dflash.plan.compose import CONF, compose
from dflash.plan.flops import train_flops
from dflash.plan.memory import MODE_WORDS, GiB, Setup, Shape
from dflash.plan.targets import TARGETS
from dflash.target.identity import moe_experts as read_experts
from dflash.target.loading import DTYPES, local_model_dir
from dflash.target.sharding import sharded_parameters

RESULTS = CONF.parent / "bench" / "results"
"""The GPU checks' results of this checkout (bench/): where the plan reads a measured MFU unless mfu_results says."""


def target_config(cfg):
    """The target's text config: the published dimensions of dflash.plan.targets.TARGETS, else config.json of a local
    copy."""
    if cfg.name in TARGETS:
        cls, dims = TARGETS[cfg.name]
        return getattr(transformers, cls)(**dims)
    folder = local_model_dir(cfg.path, cfg.revision)
    if folder is None or not (folder / "config.json").exists():
        raise ConfigError(f"dflash.plan knows no dimensions for target {cfg.name!r} and finds no local copy of "
                          f"{cfg.path}; add its text config to TARGETS in dflash/plan/targets.py, or point target.path "
                          f"at a model folder (a built-in target is built by its first use, e.g. by train.py)")
    return transformers.AutoConfig.from_pretrained(str(folder)).get_text_config()


def count_prompts(data: dict) -> int | None:
    """Prompts the configured data holds after data.offset and data.limit, None when the source is not at
    hand (a path that is not here, or data.prompts still unset)."""
    if data.get("prompts") is None:
        return None
    try:
        n = len(read_records(data["prompts"], data.get("format", "auto"), data.get("split", "train")))
    except (DFlashError, OSError, ValueError, ImportError):  # not here or unreadable: the run itself says why
        return None
    n = max(0, n - data.get("offset", 0))
    return min(n, data["limit"]) if data.get("limit") else n


@functools.cache
def composed_checkpointing(overrides: tuple[str, ...]) -> bool:
    """Whether `overrides` compose to full gradient checkpointing (how costs.recomputed reads a preset step of an
    older GPU result); auto (not recorded) is taken as off, as are overrides this checkout no longer composes."""
    try:
        return compose(list(overrides))["train"].gradient_checkpointing == "full"
    except Exception:  # noqa: BLE001 - overrides this checkout no longer composes: taken as a plain step
        return False


def mfu_of(opts: PlanConfig, experiment: str | None = None) -> tuple[float, str, bool | None]:
    """(MFU, where it is from, whether its step recomputed its layers: None where given with mfu=) of the plan:
    mfu= where given, else measured in opts.mfu_results (this checkout's bench/results by default; the experiment
    preset's own step where measured), else costs.ASSUMED_MFU."""
    if opts.mfu:
        return opts.mfu, "mfu=", None
    results = Path(opts.mfu_results).expanduser() if opts.mfu_results else RESULTS
    shown = "bench/results" if results == RESULTS else str(results)
    if opts.mfu_results and not results.is_dir():
        raise ConfigError(f"mfu_results={opts.mfu_results}: no such folder; give a folder of GPU check results "
                          f"(JSON, as bench/results/ holds), or mfu=<a number>")
    measured = costs.measured_mfu(results, experiment, composed_checkpointing, shown)
    return measured or (costs.ASSUMED_MFU, f"assumed: no GPU result with an MFU in {shown}/", False)


def sequence_flops(drafter, s: Shape, tokens: int, num_anchors: int) -> dict[str, float]:
    """FLOPs of one sequence of `tokens` tokens, all response, `num_anchors` blocks spread over it: {"drafter": the
    training step's model FLOPs, "recompute": the layers' forward again (what gradient checkpointing adds: a third
    of what their forward and backward cost), "target": the target's forward} (what costs.gpu_hours takes)."""
    n = max(1, min(num_anchors, tokens - 1))
    ids = torch.zeros(1, tokens, dtype=torch.long)
    blocks = pack_blocks(ids, torch.ones(1, tokens, dtype=torch.bool), torch.tensor([tokens]),
                         [torch.linspace(0, tokens - 2, n).round().long()], s.block_size, 0)
    f = train_flops(drafter, blocks)
    # what is not the layers': train_flops of the drafter without them
    rest = train_flops(SimpleNamespace(config=drafter.config, block_size=drafter.block_size, fc=drafter.fc,
                                       layers=(), layer_types=()), blocks)
    drafter_flops = f["matmul"] + f["attention"]
    active = s.target_active_params or s.target_params  # MoE: the experts a token is routed to
    return {"drafter": drafter_flops, "recompute": (drafter_flops - rest["matmul"] - rest["attention"]) / 3,
            "target": 2 * (active - s.heads_params) * tokens}


def read_tau(spec: str, target_path: str, block_size: int) -> tuple[float, str]:
    """tau= of the plan: a number, an evaluation's summary.json (eval/live_tau, else teacher-forced eval/tau), or
    <references file>:<benchmark> (conf/references/<name>.yaml: the entry for this target and block size)."""
    try:
        return float(spec), "given as tau="
    except ValueError:
        pass
    path = Path(spec).expanduser()
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"tau={spec}: no such file; give a number, an evaluation's summary.json or "
                              f"<references>:<benchmark> (e.g. dflash_paper:gsm8k)")
        metrics = json.loads(path.read_text()).get("metrics", {})
        for key in ("eval/live_tau", "eval/tau"):
            if key in metrics:
                return float(metrics[key]), f"{key} of {path}"
        raise ConfigError(f"tau={spec}: that summary.json has neither eval/live_tau nor eval/tau")
    name, _, bench = spec.partition(":")
    file = Path(name).expanduser() if name.endswith((".yaml", ".yml")) else \
        CONF / "references" / f"{name}.yaml"
    if not bench or not file.is_file():
        raise ConfigError(f"tau={spec}: give a number, an evaluation's summary.json, or <references>:<benchmark> "
                          f"with a file of conf/references/ (e.g. dflash_paper:gsm8k)")
    entries = yaml.safe_load(file.read_text())["references"]
    found = [e for e in entries if e.get("target") == target_path and e.get("block_size") == block_size]
    if not found or bench not in found[0]["tau"]:
        have = [f"{e['name']} ({e.get('target')}, block {e.get('block_size')}): {', '.join(e['tau'])}" for e in entries]
        raise ConfigError(f"tau={spec}: {file.name} has no {bench!r} for target {target_path} at block size "
                          f"{block_size}; it has {'; '.join(have)}")
    e = found[0]
    return float(e["tau"][bench]), f"{e['name']}, {bench}, temperature {e.get('temperature')}: {e['source']}"


def moe_experts(text) -> tuple[int, int]:
    """(experts, experts a token runs through) of a text config's MoE layers (dflash.target.identity's reading of
    the families' spellings); (0, 0) for a dense model, or one whose experts per token the config does not say."""
    experts, top_k = read_experts(text)
    return (experts, top_k) if experts and top_k else (0, 0)


def active_intermediate(text) -> int:
    """The MLP width one token runs through in a target layer (what the forward's MLP transients scale with): the
    dense intermediate_size, or for MoE top_k x the expert width, plus a shared expert (Qwen3.5/3.6 MoE) and the
    dense MLP Gemma 4 runs beside its experts. GPT-OSS names its expert width intermediate_size."""
    experts, top_k = moe_experts(text)
    if not experts:
        return int(text.intermediate_size)
    width = top_k * int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    width += int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    if getattr(text, "enable_moe_block", False):  # Gemma 4: dense MLP and experts side by side
        width += int(text.intermediate_size)
    return width


def sliding_window(text) -> int:
    """The window of a target's sliding-window layers (text config), 0 when it has none."""
    types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    return int(window) if window and "sliding_attention" in types else 0


def shape_of(drafter, vocab: int, tied: bool = False, **target) -> Shape:
    """The Shape of a DFlashDraftModel on any device, meta included; `target`: the target's fields of Shape that
    online training needs (target_params, target_intermediate, ...), else none."""
    c, params = drafter.config, list(drafter.parameters())
    selector = drafter.candidate_selector
    return Shape(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                 head_dim=drafter.layers[0].self_attn.head_dim, intermediate=c.intermediate_size,
                 layers=c.num_hidden_layers, block_size=drafter.block_size, vocab=vocab,
                 target_layers=len(drafter.target_layer_ids), params=sum(p.numel() for p in params),
                 layer_params=sum(p.numel() for p in drafter.layers[0].parameters()),
                 largest_param=max(p.numel() for p in params), tied=tied,
                 layer_types=tuple(sorted(set(drafter.layer_types))), dflash2=drafter.kind == "dflash2",
                 selector_rank=selector.predecessor_codebook.shape[1] if selector is not None else 0,
                 selector_top_k=selector.top_k if selector is not None else 0, **target)


PLAN_CHECKPOINTING = {**{mode: value for value, mode in MODE_WORDS.items()}, "auto": False}
"""Setup.checkpointing, the plan's value (as its tables and JSON print it: false, "selective", true), of each
train.gradient_checkpointing mode: memory.MODE_WORDS read backwards, and auto (decided for a device) as off."""


def checkpointing_of(mode: str) -> bool | str:
    """Setup.checkpointing for a train.gradient_checkpointing mode: auto (decided for a device) as off."""
    return PLAN_CHECKPOINTING[mode]


def setup_of(target, train, loss, noise, max_length: int, world: int = 1, allowance: float = 2 * GiB,
             fragmentation: float = 0.1, optim=None) -> Setup:
    """The Setup of a configured step (the target, train, loss and noise config groups, data.max_length) on one of
    `world` processes; train.attention=auto and mixed_precision=auto are what they are on a GPU (flex, bf16);
    gradient_checkpointing=auto is off here (choose_checkpointing decides it for a device)."""
    return Setup(ctx_len=max_length, num_anchors=train.num_anchors, batch=train.batch_size,
                 grad_accum=train.grad_accum, compute=4 if train.mixed_precision == "no" else 2,
                 frozen=DTYPES[target.dtype].itemsize, backend="sdpa" if train.attention == "sdpa" else "flex",
                 checkpointing=checkpointing_of(train.gradient_checkpointing), chunk_logits=loss.chunk_logits,
                 noise=noise.kind != "none", online=train.mode == "online", world=world,
                 distributed=train.distributed, allowance=allowance, fragmentation=fragmentation,
                 tensor_parallel=target.tensor_parallel, target_attention=target.attn_implementation,
                 foreach=optim is not None and str(optim.fused).lower() == "false")


def active_params(model, text) -> int:
    """Parameters a token runs through: all but the experts it is not routed to (the target forward's FLOPs)."""
    experts, top_k = moe_experts(text)
    named = {id(p): (n, p.numel()) for n, p in model.named_parameters()}.values()
    total = sum(k for _, k in named)
    if not experts:
        return total
    expert = sum(k for n, k in named if ".experts." in n)
    return total - expert + expert * top_k // experts


def drafter_shape(drafter, vocab: int, tied: bool = False, target=None, tensor_parallel: int = 1) -> Shape:
    """The Shape of a DFlashDraftModel on any device, meta included; `target` (a causal LM, meta included,
    and its text config) adds what online training and loading need: the target's parameters a GPU holds (its
    share of a tensor-parallel group of `tensor_parallel`, dflash.target.sharding.sharded_parameters)."""
    extra = {}
    if target is not None:
        model, text = target
        sizes = sorted({id(p): p.numel() for p in model.parameters()}.values(), reverse=True)
        extra = {"target_params": sharded_parameters(model, tensor_parallel),
                 "target_intermediate": active_intermediate(text), "target_active_params": active_params(model, text),
                 "target_largest": tuple(sizes[:costs.LOADER_THREADS]), "target_window": sliding_window(text)}
    return shape_of(drafter, vocab, tied, **extra)
