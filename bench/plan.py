"""Memory plan of one training step per GPU, and what the run needs besides, before renting GPUs.

    python -m bench.plan experiment=qwen3_6_27b
    python -m bench.plan experiment=qwen3_8b train.num_anchors=1024 gpu_gb=[80,141]
    python -m bench.plan experiment=qwen3_6_27b train.distributed=fsdp world_size=8 --json

Arguments: train.py's Hydra overrides (conf/train.yaml) plus plan-only keys: gpu_gb (GiB, one or a list;
default [80,141]), world_size (data-parallel processes; 1), allowance_gb (CUDA context, NCCL; 2),
fragmentation (share of the peak lost to the caching allocator; 0.1), sequences and tokens_per_sequence
(the training data; default: the prompts data.prompts holds, else the DFlash paper's ~800K, and 1500
tokens, the paper's ~1.2B tokens / 800K, at most data.max_length), mfu (default: measured on a GPU, from
bench/results/: the experiment preset's own step where measured, else the median; with none, 0.35),
peak_tflops (the GPU's dense bf16; 989, H100/H200) and disk_tb (room for a feature cache; 20). --json prints
JSON.

The drafter is built with build_drafter on the meta device at the real dimensions (exact parameter count,
nothing allocated), the target likewise (online training keeps it whole on every GPU). The memory model and
what it assumes: dflash/train/memory.py; cache, host memory, GPU-hours and the recommended set-up per GPU
size: bench/plan_costs.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

from bench import plan_costs
from bench.plan_config import compose
from bench.plan_costs import PAPER_SEQUENCES, PAPER_TOKENS, Run
from dflash.train.memory import (
    BUILD_BYTES,
    DENSE_MASK_BYTES,
    MODES,
    PERSISTENT,
    GiB,
    Setup,
    Shape,
    active_intermediate,
    block_mask_bytes,
    breakdown,
    flex_padded,
    layer_activations,
    max_anchors,
    moe_experts,
    peak,
    phases,
    sdpa_chunks,
    setup_of,
    shape_of,
    sliding_window,
    state_terms,
    terms,
)

__all__ = [
    "BUILD_BYTES",
    "DENSE_MASK_BYTES",
    "MODES",
    "PERSISTENT",
    "TARGETS",
    "GiB",
    "Setup",
    "Shape",
    "active_intermediate",
    "active_params",
    "block_mask_bytes",
    "breakdown",
    "build",
    "compose",
    "drafter_shape",
    "flex_padded",
    "layer_activations",
    "main",
    "make_plan",
    "max_anchors",
    "moe_experts",
    "peak",
    "phases",
    "render",
    "sdpa_chunks",
    "state_terms",
    "terms",
]

PLAN_KEYS = {"gpu_gb": [80, 141], "world_size": 1, "allowance_gb": 2.0, "fragmentation": 0.1, "sequences": 0,
             "tokens_per_sequence": 0, "mfu": 0.0, "peak_tflops": 989.0, "disk_tb": 20.0}

# The real targets' text models as published (config.json on the hub of the repo each conf/target preset names;
# the text_config of the multimodal ones), so a plan needs no download. Keys that change no parameter count (the
# rope of some, token ids) are left at the class defaults where not verified.
# Qwen3.6-27B shares Qwen3.5-27B's text model (model_type qwen3_5).
_QWEN3_5_27B = ("Qwen3_5TextConfig", {
    "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "intermediate_size": 17408,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}})
# Gemma 4 (Gemma4ForConditionalGeneration; its text_config, model_type gemma4_text): 5 sliding-window layers
# (window 1024, head_dim 256) then 1 full layer (global_head_dim 512, num_global_key_value_heads, keys reused as
# values), no per-layer embeddings (hidden_size_per_layer_input 0), no KV sharing, logits soft-capped at 30.
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
_GEMMA4 = {"vocab_size": 262144, "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True,
           "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "sliding_window": 1024,
           "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "max_position_embeddings": 262144,
           "rms_norm_eps": 1e-6, "rope_parameters": _GEMMA4_ROPE}
# GPT-OSS: alternating sliding-window (128) and full layers, attention sinks and biases, MoE of experts 2880 wide
# (intermediate_size is the expert's), YaRN rope; the hub's MXFP4 experts are counted as loaded (bf16).
_GPT_OSS = {"hidden_size": 2880, "vocab_size": 201088, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4, "sliding_window": 128,
            "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False}}
TARGETS = {
    # transformers' MiniMaxM2Config defaults are MiniMax-M2's dimensions (its docstring), which M2.5 keeps: 62 layers,
    # hidden 3072, 48/8 heads x 128, 256 experts 1536 wide (top 8), vocab 200064
    "minimax_m2_5": ("MiniMaxM2Config", {}),
    "qwen3_8b": ("Qwen3Config", {
        "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    "qwen3_5_27b": _QWEN3_5_27B,
    "qwen3_6_27b": _QWEN3_5_27B,
    "llama3_1_8b_instruct": ("LlamaConfig", {
        "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "gemma4_31b_it": ("Gemma4TextConfig", {
        **_GEMMA4, "hidden_size": 5376, "num_hidden_layers": 60, "intermediate_size": 21504, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}),
    # a dense MLP (2112 wide) and 128 experts (704 wide, top 8) side by side in every layer
    "gemma4_26b_a4b_it": ("Gemma4TextConfig", {
        **_GEMMA4, "hidden_size": 2816, "num_hidden_layers": 30, "intermediate_size": 2112, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "enable_moe_block": True, "num_experts": 128,
        "top_k_experts": 8, "moe_intermediate_size": 704,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5}),
    "gpt_oss_20b": ("GptOssConfig", {
        **_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 12}),
    "gpt_oss_120b": ("GptOssConfig", {
        **_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18}),
    # intermediate_size is the dense MLP of mlp_only_layers (none here); every layer is 128 experts, top 8.
    # rope not verified (no parameter depends on it): the class default
    "qwen3_coder_30b_a3b": ("Qwen3MoeConfig", {
        "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}),
    # hybrid like Qwen3.5 (3 Gated DeltaNet layers to 1 full-attention layer), every layer 256 experts (512 wide,
    # top 8) and a shared expert (512 wide); no dense MLP (the class has no intermediate_size)
    "qwen3_6_35b_a3b": ("Qwen3_5MoeTextConfig", {
        "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}}),
}


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
    from dflash.target.sharding import sharded_parameters

    extra = {}
    if target is not None:
        model, text = target
        sizes = sorted({id(p): p.numel() for p in model.parameters()}.values(), reverse=True)
        extra = {"target_params": sharded_parameters(model, tensor_parallel),
                 "target_intermediate": active_intermediate(text), "target_active_params": active_params(model, text),
                 "target_largest": tuple(sizes[:plan_costs.LOADER_THREADS]), "target_window": sliding_window(text)}
    return shape_of(drafter, vocab, tied, **extra)


def target_config(cfg):
    """The target's text config: the published dimensions above, else config.json of a local copy."""
    import transformers

    if cfg.name in TARGETS:
        cls, dims = TARGETS[cfg.name]
        return getattr(transformers, cls)(**dims)
    from dflash.errors import ConfigError
    from dflash.target.loading import local_model_dir

    folder = local_model_dir(cfg.path, cfg.revision)
    if folder is None or not (folder / "config.json").exists():
        raise ConfigError(f"bench.plan knows no dimensions for target {cfg.name!r} and finds no local copy of "
                          f"{cfg.path}; add its text config to TARGETS in bench/plan.py, or point target.path "
                          f"at a model folder (a built-in target is built by its first use, e.g. by train.py)")
    return transformers.AutoConfig.from_pretrained(str(folder)).get_text_config()


def build(job: dict, world: int = 1, allowance_gb: float = 2.0, fragmentation: float = 0.1):
    """(drafter on the meta device, Shape, Setup) for the composed config groups in `job`."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from dflash.drafter.build import build_drafter
    from dflash.target.loading import Target

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


def make_run(job: dict, opts: dict, experiment: str | None = None) -> Run:
    """The Run the costs are for: the plan keys where given, else the configured data and a measured MFU (the
    experiment preset's own step where a GPU result has it)."""
    counted = plan_costs.count_prompts(job.get("data", {}))
    sequences = opts.get("sequences") or counted or PAPER_SEQUENCES
    where = ("sequences=" if opts.get("sequences") else "data.prompts" if counted
             else "the DFlash paper's ~800K: data.prompts is not at hand; sequences=N sets it")
    tokens = opts.get("tokens_per_sequence") or min(job["max_length"], round(PAPER_TOKENS / PAPER_SEQUENCES))
    measured = plan_costs.measured_mfu(experiment=experiment)
    mfu, mfu_where, recomputed = ((opts["mfu"], "mfu=", None) if opts.get("mfu") else measured if measured
                                  else (plan_costs.ASSUMED_MFU, Run.mfu_where, False))
    train = job["train"]
    return Run(sequences=int(sequences), tokens_per_sequence=int(tokens), sequences_where=where,
               epochs=train.epochs, max_steps=train.max_steps, storage=job.get("storage", "bfloat16"),
               peak_tflops=opts.get("peak_tflops", 989.0), mfu=mfu, mfu_where=mfu_where, mfu_recomputed=recomputed,
               disk_tb=opts.get("disk_tb", 20.0))


def make_plan(shape: Shape, setup: Setup, gpu_gb: list[float], drafter=None, run: Run | None = None) -> dict:
    """Terms, peaks and the largest num_anchors per GPU size, in GiB (what --json prints); with the meta
    drafter and a Run, also the run's needs offline and online (bench/plan_costs.py)."""
    t = {k: v / GiB for k, v in terms(shape, setup).items()}
    peaks, gpus = {}, []
    for name, ckpt in MODES.items():
        total, phase = peak(shape, replace(setup, checkpointing=ckpt))
        peaks[name] = {"gib": total / GiB, "phase": phase}
    chosen = peaks["checkpointing" if setup.checkpointing else "no checkpointing"]["gib"]
    for gb in gpu_gb:
        gpus.append({"gpu_gib": gb, "fits": chosen <= gb, "free_gib": gb - chosen, "max_num_anchors": {
            name: max_anchors(shape, replace(setup, checkpointing=ckpt), gb * GiB) for name, ckpt in MODES.items()}})
    masks = {k: v / setup.batch for k, v in block_mask_bytes(shape, setup).items()} if setup.backend == "flex" else {}
    out = {"shape": asdict(shape), "setup": asdict(setup), "terms_gib": t, "peak": peaks, "gpus": gpus,
           "block_mask_bytes_per_sequence": masks}
    if drafter is not None and run is not None:
        per_token = plan_costs.cache_bytes_per_token(shape, run.storage)
        cache = per_token * run.sequences * run.tokens_per_sequence
        out["run"] = {
            **asdict(run),
            "cache_gb_per_million_tokens": {k: plan_costs.cache_bytes_per_token(shape, k) / 1e3
                                            for k in ("bfloat16", "float8_e4m3fn")},
            "cache_tb": cache / 1e12,
            "loading_gib": {k: v / GiB for k, v in plan_costs.loading_bytes(shape, setup.frozen).items()},
            "peak_gib": {m: peak(shape, replace(setup, online=m == "online"))[0] / GiB for m in ("offline", "online")},
            "gpu_hours": plan_costs.gpu_hours(drafter, shape, setup, run),
            "recommended": [{**r, "peak": r["peak"] and r["peak"] / GiB,
                             "modes": {m: {**f, "peak": f["peak"] and f["peak"] / GiB} for m, f in r["modes"].items()}}
                            for r in plan_costs.recommend(shape, setup, run, cache, gpu_gb)]}
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
        chosen = "  (configured)" if (name == "checkpointing") == u["checkpointing"] else ""
        lines.append(f"  {'peak, ' + name:<38} {p['gib']:9.2f} GiB  at {p['phase']}{chosen}")
    lines += ["", f"  {'GPU':<9} {'configured step':<24} largest train.num_anchors: no checkpointing / checkpointing"]
    for g in plan["gpus"]:
        fit = f"fits, {g['free_gib']:.1f} GiB free" if g["fits"] else f"short by {-g['free_gib']:.1f} GiB"
        n = g["max_num_anchors"]
        lines.append(f"  {g['gpu_gib']:>4g} GiB  {fit:<24} {n['no checkpointing']} / {n['checkpointing']}")
    if any(n >= u["ctx_len"] for g in plan["gpus"] for n in g["max_num_anchors"].values()):
        lines.append(f"  (a sequence has at most {u['ctx_len'] - 1} anchors; flex pads micro-batches to "
                     f"train.num_anchors blocks, so memory follows train.num_anchors)")
    if "run" in plan:
        lines += plan_costs.render_run(plan["run"], u["world"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from hydra.errors import HydraException

    from dflash.cli import fail
    from dflash.errors import ConfigError

    opts, overrides = dict(PLAN_KEYS), []
    for arg in sys.argv[1:] if argv is None else argv:
        key, _, value = arg.partition("=")
        if key == "gpu_gb":
            opts[key] = [float(v) for v in value.strip("[]").split(",") if v.strip()]
        elif key in PLAN_KEYS:
            opts[key] = type(PLAN_KEYS[key])(float(value) if isinstance(PLAN_KEYS[key], int) else value)
        elif arg != "--json":
            overrides.append(arg)
    try:
        job = compose(overrides)
        drafter, shape, setup = build(job, opts["world_size"], opts["allowance_gb"], opts["fragmentation"])
    except Exception as e:  # a bad override, or a ConfigError (omegaconf wraps those a dataclass check raises)
        cause = next((x for x in (e, e.__cause__, e.__context__) if isinstance(x, (ConfigError, HydraException))), e)
        if cause is e and not isinstance(e, (ConfigError, HydraException)):
            raise
        fail(cause)
    experiment = next((o.partition("=")[2] for o in overrides if o.startswith(("experiment=", "+experiment="))), None)
    plan = make_plan(shape, setup, opts["gpu_gb"], drafter, make_run(job, opts, experiment))
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    print(json.dumps(plan, indent=2) if as_json else render(plan, drafter, " ".join(overrides) or "conf/train.yaml"))


if __name__ == "__main__":
    main()
