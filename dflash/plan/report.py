"""The plan of a configured run: its drafter and step built on the meta device (`build`), the memory per GPU
and what the run needs besides (`make_plan`), in words (`render`); `python -m dflash.plan` (`main`).

The drafter is built with build_drafter on the meta device at the real dimensions (exact parameter count,
nothing allocated), the target likewise (online training keeps it whole on every GPU). The memory model and
what it assumes: dflash/plan/memory.py; cache, host memory, GPU-hours and the recommended set-up per GPU
size: dflash/plan/costs.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

import torch
from hydra.errors import HydraException
from torch import nn
from transformers import AutoModelForCausalLM

import dflash.plan.costs as costs
from dflash.cli import fail
from dflash.config.plan import PlanConfig
from dflash.drafter.build import build_drafter
from dflash.errors import ConfigError
from dflash.plan.compose import compose
from dflash.plan.configured import (count_prompts, drafter_shape, mfu_of, read_tau, sequence_flops, setup_of,
                                    target_config)
from dflash.plan.costs import PAPER_SEQUENCES, PAPER_TOKENS, Run
from dflash.plan.memory import (MODE_WORDS, MODES, GiB, Setup, Shape, block_mask_bytes, choose_checkpointing,
                                max_anchors, mode_name, peak, terms)
from dflash.plan.serving import plan_serving, render_serving
from dflash.target.loading import Target


def build(job: dict, world: int = 1, allowance_gb: float = 2.0, fragmentation: float = 0.1):
    """(drafter on the meta device, Shape, Setup) for the composed config groups in `job`."""
    tcfg, train = job["target"], job["train"]
    text = target_config(tcfg)
    H, V = text.hidden_size, text.vocab_size
    with torch.device("meta"):
        target = Target(model=None, tokenizer=None, config=text, layers=None, final_norm=None,
                        embed_tokens=nn.Embedding(V, H), lm_head=nn.Linear(H, V, bias=False),
                        mask_token_id=tcfg.mask_token_id, path=tcfg.path)
        drafter = build_drafter(job["drafter"], job["layers"], target)
        model = AutoModelForCausalLM.from_config(text)  # the causal LM online training keeps whole
    shape = drafter_shape(drafter, V, bool(getattr(text, "tie_word_embeddings", False)), (model, text),
                          tcfg.tensor_parallel)
    setup = setup_of(tcfg, train, job["loss"], job["noise"], job["max_length"], world, allowance_gb * GiB,
                     fragmentation, job.get("optim"))
    return drafter, shape, setup


def make_run(job: dict, opts: PlanConfig, experiment: str | None = None) -> Run:
    """The Run the costs are for: the plan keys where given, else the configured data and a measured MFU (the
    experiment preset's own step where a GPU result has it)."""
    counted = count_prompts(job.get("data", {}))
    sequences = opts.sequences or counted or PAPER_SEQUENCES
    where = ("sequences=" if opts.sequences else "data.prompts" if counted
             else "the DFlash paper's ~800K: data.prompts is not at hand; sequences=N sets it")
    tokens = opts.tokens_per_sequence or min(job["max_length"], round(PAPER_TOKENS / PAPER_SEQUENCES))
    mfu, mfu_where, recomputed = mfu_of(opts, experiment)
    train = job["train"]
    return Run(sequences=int(sequences), tokens_per_sequence=int(tokens), sequences_where=where,
               epochs=train.epochs, max_steps=train.max_steps, storage=job.get("storage", "bfloat16"),
               peak_tflops=opts.peak_tflops, mfu=mfu, mfu_where=mfu_where, mfu_recomputed=recomputed,
               disk_tb=opts.disk_tb)


def make_plan(shape: Shape, setup: Setup, gpu_gb: list[float], drafter=None, run: Run | None = None,
              auto_checkpointing: bool = False) -> dict:
    """Terms, peaks and the largest num_anchors per GPU size, in GiB (what --json prints); with the meta
    drafter and a Run, also the run's needs offline and online (dflash/plan/costs.py). Each GPU size says what
    train.gradient_checkpointing=auto chooses there; with auto_checkpointing (the configured value) its step is
    the one each GPU's fit is judged by."""
    t = {k: v / GiB for k, v in terms(shape, setup).items()}
    peaks, gpus = {}, []
    for name, ckpt in MODES.items():
        total, phase = peak(shape, replace(setup, checkpointing=ckpt))
        peaks[name] = {"gib": total / GiB, "phase": phase}
    for gb in gpu_gb:
        auto = choose_checkpointing(shape, setup, gb * GiB)[0]  # what train.gradient_checkpointing=auto takes there
        chosen = peaks[mode_name(auto if auto_checkpointing else setup.checkpointing)]["gib"]
        gpus.append({"gpu_gib": gb, "auto_checkpointing": auto, "fits": chosen <= gb, "free_gib": gb - chosen,
                     "max_num_anchors": {name: max_anchors(shape, replace(setup, checkpointing=ckpt), gb * GiB)
                                         for name, ckpt in MODES.items()}})
    masks = {k: v / setup.batch for k, v in block_mask_bytes(shape, setup).items()} if setup.backend == "flex" else {}
    out = {"shape": asdict(shape), "setup": asdict(setup), "terms_gib": t, "peak": peaks, "gpus": gpus,
           "auto_checkpointing": auto_checkpointing,
           "block_mask_bytes_per_sequence": masks}
    if drafter is not None and run is not None:
        per_token = costs.cache_bytes_per_token(shape, run.storage)
        cache = per_token * run.sequences * run.tokens_per_sequence
        out["run"] = {
            **asdict(run),
            "cache_gb_per_million_tokens": {k: costs.cache_bytes_per_token(shape, k) / 1e3
                                            for k in ("bfloat16", "float8_e4m3fn")},
            "cache_tb": cache / 1e12,
            "loading_gib": {k: v / GiB for k, v in costs.loading_bytes(shape, setup.frozen).items()},
            "peak_gib": {m: peak(shape, replace(setup, online=m == "online"))[0] / GiB for m in ("offline", "online")},
            "gpu_hours": costs.gpu_hours(sequence_flops(drafter, shape, run.tokens_per_sequence, setup.num_anchors),
                                         shape, setup, run),
            "recommended": [{**r, "peak": r["peak"] and r["peak"] / GiB,
                             "modes": {m: {**f, "peak": f["peak"] and f["peak"] / GiB} for m, f in r["modes"].items()}}
                            for r in costs.recommend(shape, setup, run, cache, gpu_gb)]}
    return out


def render(plan: dict, drafter, title: str) -> str:
    s, u = plan["shape"], plan["setup"]
    types = ", ".join(f"{t} x{drafter.layer_types.count(t)}" for t in dict.fromkeys(drafter.layer_types))
    kind = (f"DFlash 2 (convolutions, selector top-{s['selector_top_k']} rank {s['selector_rank']}), "
            if s.get("dflash2") else "")
    head = (f"drafter: {kind}{s['layers']} layers ({types}), {s['params'] / 1e9:.3f} B parameters, hidden {s['hidden']}, "
            f"heads {s['heads']}/{s['kv_heads']} x {s['head_dim']}, MLP {s['intermediate']}, block {s['block_size']}, "
            f"fc from {s['target_layers']} target layers; vocab {s['vocab']} ({'tied' if s['tied'] else 'untied'})")
    step = (f"per GPU: {u['batch']} x {u['ctx_len']} context tokens, num_anchors {u['num_anchors']} "
            f"({u['batch'] * u['num_anchors'] * s['block_size']} block tokens), "
            f"{'bf16 autocast' if u['compute'] == 2 else 'float32'}, {u['backend']} attention, "
            f"{'online' if u['online'] else 'offline'}, {u['distributed']} x {u['world']}"
            + (f", the target tensor parallel x {u['tensor_parallel']} (its share per GPU)"
               if u.get("tensor_parallel", 1) > 1 else ""))
    lines = [f"memory plan: {title}", head, step, ""]
    lines += [f"  {k:<38} {v:9.2f} GiB" for k, v in plan["terms_gib"].items() if v]
    lines.append(f"  {'fixed allowance (CUDA context, NCCL)':<38} {u['allowance'] / GiB:9.2f} GiB")
    if masks := plan["block_mask_bytes_per_sequence"]:  # bytes, too few for the GiB table
        lines.append(f"  block masks a sequence: {masks['kept'] / 2**20:.2f} MiB kept, {masks['build'] / 2**20:.1f} MiB "
                     f"to build (create_block_mask's dense build: {masks['dense before'] / GiB:.2f} GiB)")
    lines.append(f"  peak = persistent terms + the largest phase, + {u['fragmentation']:.0%} fragmentation + allowance:")
    for name, p in plan["peak"].items():
        configured = not plan.get("auto_checkpointing") and name == mode_name(u["checkpointing"])
        chosen = "  (configured)" if configured else ""
        lines.append(f"  {'peak, ' + name:<38} {p['gib']:9.2f} GiB  at {p['phase']}{chosen}")
    lines += ["", f"  {'GPU':<9} {'configured step':<24} {'auto':<10} largest train.num_anchors: no checkpointing / "
                  f"selective / full"]
    for g in plan["gpus"]:
        fit = f"fits, {g['free_gib']:.1f} GiB free" if g["fits"] else f"short by {-g['free_gib']:.1f} GiB"
        n = g["max_num_anchors"]
        lines.append(f"  {g['gpu_gib']:>4g} GiB  {fit:<24} {MODE_WORDS[g['auto_checkpointing']]:<10} "
                     f"{n['no checkpointing']} / {n['selective checkpointing']} / {n['checkpointing']}")
    lines.append("  (auto: what train.gradient_checkpointing=auto chooses on that GPU: off where the step fits without "
                 "it, else selective where that fits, else full"
                 + ("; configured, so each GPU's step is auto's)" if plan.get("auto_checkpointing") else ")"))
    if any(n >= u["ctx_len"] for g in plan["gpus"] for n in g["max_num_anchors"].values()):
        lines.append(f"  (a sequence has at most {u['ctx_len'] - 1} anchors; flex pads micro-batches to "
                     f"train.num_anchors blocks, so memory follows train.num_anchors)")
    if "run" in plan:
        lines += costs.render_run(plan["run"], u["world"])
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[PlanConfig, list[str], dict, bool]:
    """(plan keys, Hydra overrides, compose's config_dir and config_name, --json) from the command line. Like
    train.py's, it takes --config-dir / -cd (a folder of the user's own configs, searched beside conf/) and
    --config-name / -cn (the primary config, train by default), as `--config-dir DIR` or `--config-dir=DIR`."""
    parser = argparse.ArgumentParser(prog="python -m dflash.plan", add_help=False, allow_abbrev=False)
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--config-name", "-cn", default="train")
    parser.add_argument("--json", action="store_true")
    flags, rest = parser.parse_known_args(argv)
    opts, overrides, keys = PlanConfig(), [], PlanConfig.keys()
    for arg in rest:
        key, _, value = arg.partition("=")
        if arg.startswith("-"):  # Hydra would read it as an override and fail on its lexer
            raise ConfigError(f"python -m dflash.plan: {arg} is not an option; it takes train.py's overrides, plan "
                              f"keys ({', '.join(keys)}), --config-dir, --config-name and --json")
        if key in keys:
            opts.set(key, value)
        else:
            overrides.append(arg)
    return opts, overrides, {"config_dir": flags.config_dir, "config_name": flags.config_name}, flags.json


def main(argv: list[str] | None = None) -> None:
    try:
        opts, overrides, where, as_json = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(e)
    try:
        job = compose(overrides, **where)
        drafter, shape, setup = build(job, opts.world_size, opts.allowance_gb, opts.fragmentation)
    except Exception as e:  # a bad override, or a ConfigError (omegaconf wraps those a dataclass check raises)
        cause = next((x for x in (e, e.__cause__, e.__context__) if isinstance(x, (ConfigError, HydraException))), e)
        if cause is e and not isinstance(e, (ConfigError, HydraException)):
            raise
        fail(cause)
    if opts.concurrency:
        try:
            text = target_config(job["target"])
            tau, tau_where = read_tau(opts.tau, job["target"].path, shape.block_size) if opts.tau else (None, None)
            plan = plan_serving(shape, text, opts, tau, tau_where)
        except ConfigError as e:
            fail(e)
        print(json.dumps(plan, indent=2) if as_json else render_serving(plan))
        return
    try:
        experiment = next((o.partition("=")[2] for o in overrides if o.startswith(("experiment=", "+experiment="))),
                          None)
        run = make_run(job, opts, experiment)
    except ConfigError as e:
        fail(e)
    plan = make_plan(shape, setup, opts.gpu_gb, drafter, run,
                     auto_checkpointing=job["train"].gradient_checkpointing == "auto")
    flags = ([f"--config-dir {where['config_dir']}"] if where["config_dir"] else []) + (
        [f"--config-name {where['config_name']}"] if where["config_name"] != "train" else [])
    print(json.dumps(plan, indent=2) if as_json else render(plan, drafter, " ".join(flags + overrides)
                                                            or "conf/train.yaml"))
