"""Memory plan of one training step per GPU, before renting GPUs.

    python -m bench.plan experiment=qwen3_6_27b
    python -m bench.plan experiment=qwen3_8b train.num_anchors=1024 gpu_gb=[80,141]
    python -m bench.plan experiment=qwen3_6_27b train.distributed=fsdp world_size=8 --json

Arguments: train.py's Hydra overrides (conf/train.yaml) plus plan-only keys: gpu_gb (GiB, one or a list;
default [80,141]), world_size (data-parallel processes; 1), allowance_gb (CUDA context, NCCL; 2) and
fragmentation (share of the peak lost to the caching allocator; 0.1). --json prints JSON.

The drafter is built with build_drafter on the meta device at the real dimensions (exact parameter count,
nothing allocated). Activations are the tensors autograd saves, as model.py, blocks.py and loss.py make
them; tests/test_plan.py checks the estimate against measured peaks of real steps on CPU. Assumed:
- float32 parameters, gradients and AdamW moments; under bf16 autocast (train.mixed_precision auto/bf16,
  the GPU default) linear layers and attention compute in bfloat16, the rest in float32; the features
  arrive in float32 (sources.py reads the cache so), so the residual stream is float32;
- the target's frozen embed_tokens and lm_head on the GPU in target.dtype, twice unless tied; online
  mode adds the whole target in target.dtype (its own no-grad forward is not modelled);
- every sequence has data.max_length tokens and train.num_anchors blocks (the padded shape; flex pads
  the context to a multiple of 256); flex attention saves its output and log-sum-exp, no scores; the sdpa
  path (CPU) saves per chunk of blocks the keys, values and float mask it sees, anchors spread evenly;
- flex keeps one BlockMask per layer type through the step (int32 tile lists, packed_block_mask); the
  temporaries that build it are freed before the forward, so they never set the peak;
- gradient checkpointing keeps each layer's input and recomputes one layer at a time in backward;
- DDP (world_size > 1) keeps a second copy of the gradients in its buckets; FSDP shards parameters,
  gradients and AdamW state and gathers the whole drafter in the compute dtype (accelerate's default
  wrap policy makes it one FSDP unit);
- the peak is the largest of four phases: the loss backward (all activations and a chunk of logits), the
  drafter layers (a layer's forward or backward working set on top), the end of backward (all gradients)
  and the optimizer step (AdamW's foreach temporaries on CUDA).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GiB = 2**30
MODES = {"no checkpointing": False, "checkpointing": True}
PLAN_KEYS = {"gpu_gb": [80, 141], "world_size": 1, "allowance_gb": 2.0, "fragmentation": 0.1}

# The real targets' text models as published (config.json on the hub), so a plan needs no download.
# Qwen3.6-27B shares Qwen3.5-27B's text model (model_type qwen3_5).
_QWEN3_5_27B = ("Qwen3_5TextConfig", {
    "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "intermediate_size": 17408,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}})
TARGETS = {
    "qwen3_8b": ("Qwen3Config", {
        "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    "qwen3_5_27b": _QWEN3_5_27B,
    "qwen3_6_27b": _QWEN3_5_27B,
}


@dataclass
class Shape:
    """The drafter and target dimensions the estimate needs (`drafter_shape` reads them off a drafter)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    block_size: int
    vocab: int
    target_layers: int  # feeding fc: the features are target_layers x hidden wide
    params: int
    layer_params: int
    largest_param: int
    tied: bool = False  # the target ties embed_tokens and lm_head (one frozen matrix)
    target_params: int = 0
    layer_types: tuple[str, ...] = ("full_attention",)  # distinct drafter layer types: one attention mask each


@dataclass
class Setup:
    """One micro-batch on one GPU; sizes in tokens, dtypes in bytes per element."""

    ctx_len: int
    num_anchors: int
    batch: int = 1
    grad_accum: int = 1  # > 1: the gradients of earlier micro-batches stay through forward and backward
    compute: int = 2  # linear and attention activations: 2 under bf16 autocast, 4 without
    frozen: int = 2  # the frozen embed_tokens / lm_head (target.dtype)
    backend: str = "flex"
    checkpointing: bool = False
    chunk_logits: int = 134217728
    noise: bool = False
    online: bool = False
    world: int = 1
    distributed: str = "ddp"
    foreach: bool = True  # AdamW's foreach path (CUDA): a temporary the size of the parameters in the step
    allowance: float = 2 * GiB
    fragmentation: float = 0.1


def sdpa_chunks(s: Shape, u: Setup) -> tuple[int, int]:
    """(keys, mask entries) summed over the sdpa path's chunks of blocks (packed_attention_masks), the
    anchors spread evenly over [0, ctx_len - 2]."""
    from dflash.drafter.blocks import BLOCKS_PER_CHUNK_TOKENS

    n, size = u.num_anchors, s.block_size
    per, keys, entries = max(1, BLOCKS_PER_CHUNK_TOKENS // size), 0, 0
    for first in range(0, n, per):
        last = min(n, first + per)
        ctx = round((last - 1) * (u.ctx_len - 2) / max(n - 1, 1))  # the chunk's largest anchor
        keys += ctx + (last - first) * size
        entries += (last - first) * size * (ctx + (last - first) * size)
    return keys, entries


DENSE_MASK_BYTES = {"full_attention": 3, "sliding_attention": 20}
"""Peak bytes per [query, key] entry of create_block_mask's dense build (CPU, torch 2.13, as TensorPeak
counts; tests/test_plan.py measures it): what a flex mask cost to build before packed_block_mask."""
BUILD_BYTES = 16  # peak bytes per [query, key tile] entry of packed_block_mask's temporaries (4 x int32)


def flex_padded(u: Setup) -> Setup:
    """The Setup at the shapes draft_packed pads flex batches to (the context to a multiple of 256)."""
    from dflash.drafter.blocks import flex_padded_shape

    return replace(u, ctx_len=flex_padded_shape(u.ctx_len, u.num_anchors, u.num_anchors)[0])


def block_mask_bytes(s: Shape, u: Setup) -> dict[str, int]:
    """Bytes of a micro-batch's flex BlockMasks, one per layer type, at the padded shape. kept: their int32
    tensors, kv_num_blocks [b, 1, q_tiles] and kv_indices [b, 1, q_tiles, kv_tiles], the pair for full
    tiles, and the q-side transposes of both ([b, 1, kv_tiles], [b, 1, kv_tiles, q_tiles]); build: the
    temporaries packed_block_mask makes for one; dense before: what create_block_mask held for all."""
    from dflash.drafter.blocks import FLEX_TILE

    u = flex_padded(u)
    q = u.num_anchors * s.block_size
    q_tiles, kv_tiles = -(-q // FLEX_TILE), -(-(u.ctx_len + q) // FLEX_TILE)
    per_mask = 2 * 4 * (q_tiles + kv_tiles + 2 * q_tiles * kv_tiles)
    return {"kept": u.batch * len(s.layer_types) * per_mask,
            "build": u.batch * BUILD_BYTES * q_tiles * FLEX_TILE * kv_tiles,
            "dense before": u.batch * q * (u.ctx_len + q) * sum(DENSE_MASK_BYTES[t] for t in s.layer_types)}


def layer_activations(s: Shape, u: Setup) -> float:
    """Bytes one drafter layer saves for backward. An RMSNorm keeps its float32 input and normalised
    output; a tensor feeding n linear layers is kept once in float32, or as n bf16 casts under autocast."""
    a, b = u.compute, u.batch
    q, k = b * u.num_anchors * s.block_size, b * (u.ctx_len + u.num_anchors * s.block_size)
    hq, hkv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    fed = lambda n: 4 if a == 4 else n * a
    total = q * s.hidden * (16 + fed(1) + fed(2))  # input_layernorm (-> q_proj), post_attention_layernorm (-> gate, up)
    total += k * s.hidden * fed(2)  # cat(context, block) -> k_proj, v_proj
    total += q * hq * (4 + 4 * a) + q * s.heads * 4  # q_norm's input, normalised and rotated q, output, o_proj input
    total += q * s.intermediate * 4 * a  # gate, silu, up, their product
    if u.backend == "flex":
        return total + k * hkv * (4 + 3 * a)  # k_norm's input, normalised and rotated k; v
    keys, entries = sdpa_chunks(s, u)  # sdpa: keys and values cut per chunk of blocks, each with a float mask
    return total + k * hkv * (4 + a) + b * (keys * hkv * 2 * a + entries * a)


def breakdown(s: Shape, u: Setup) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per GPU of each part of a training step, and how the activations change in backward."""
    if u.backend == "flex":  # the shapes draft_packed pads to
        u = flex_padded(u)
    a, b, H, V, I = u.compute, u.batch, s.hidden, s.vocab, s.intermediate
    q, c, k = b * u.num_anchors * s.block_size, b * u.ctx_len, b * (u.ctx_len + u.num_anchors * s.block_size)
    rows = b * u.num_anchors * (s.block_size - 1)  # labelled slots: what goes through lm_head
    chunk_rows = min(rows, max(1, u.chunk_logits // V)) if u.chunk_logits else rows
    shard = u.world if u.distributed == "fsdp" else 1
    gathered = u.distributed == "fsdp" and u.world > 1
    t = {
        "drafter parameters (fp32)": s.params * 4 / shard,
        "gradients (fp32)": s.params * 4 / shard,
        "AdamW state (2 x fp32)": 2 * s.params * 4 / shard,
        "DDP gradient buckets": s.params * 4 if u.world > 1 and u.distributed == "ddp" else 0,
        "FSDP gathered parameters": s.params * a if gathered else 0,
        "autocast weight copies (bf16)": s.params * a if a < 4 and not gathered else 0,
        "frozen embed + lm_head": V * H * u.frozen * (1 if s.tied else 2),
        "target model (online)": s.target_params * u.frozen if u.online else 0,
        "feature batch (fp32)": c * s.target_layers * H * 4 * (2 if u.noise else 1),
        "flex block masks": block_mask_bytes(s, u)["kept"] if u.backend == "flex" else 0,
    }
    per_layer = layer_activations(s, u)
    # the final norm's input and normalised output, the rows fed to lm_head, an unchunked log-softmax:
    # all freed before the layers' backward
    loss_side = q * H * 8 + rows * H * 4 + (rows * V * 4 if chunk_rows == rows else 0)
    # fc's bf16 input, hidden_norm's input and output, rotary cos/sin, the final norm's output (the result)
    outer = c * s.target_layers * H * (a if a < 4 else 0) + c * H * (4 + a) + 2 * k * s.head_dim * 4
    outer += q * H * 4 + loss_side
    # layer 0 keeps no input (frozen embeddings need no gradient); checkpointing keeps the layers' inputs
    # and the context, and recomputes one layer's activations (but its input) at a time
    t["activations, no checkpointing"] = outer + s.layers * per_layer - q * H * 4
    t["activations, checkpointing"] = outer + s.layers * q * H * 4 + c * H * 4
    t["recomputed layer (checkpointing)"] = per_layer - q * H * 4
    # a loss chunk in backward: its float32 log-softmax (recomputed when chunked), its gradient, the logits'
    t["loss logits buffer"] = chunk_rows * V * (12 if chunk_rows < rows else 8)
    # a layer's forward: rotary temporaries of q and k, the float32 cat(context, block)
    t["layer forward working set"] = 8 * (q * s.heads + k * s.kv_heads) * s.head_dim + 4 * k * H
    # a layer's backward: the MLP's gradients in flight, down_proj's weight gradient, the residual's gradient
    t["layer backward working set"] = 2 * q * I * a + H * I * 4 + q * H * 4
    t["optimizer step temporaries"] = (s.params / shard if u.foreach else 2 * s.largest_param) * 4
    # going down the layers, backward leaves each one's weight gradients and frees what it saved (with
    # checkpointing: its input only) while the context's gradient builds up
    kept = q * H * 4 if u.checkpointing else per_layer
    lower = max(0, (s.layers - 1) * (s.layer_params * 4 / shard - kept) + c * H * 4)
    return t, {"loss side": loss_side, "lower layers": lower}


def terms(s: Shape, u: Setup) -> dict[str, float]:
    """Bytes per GPU of each part of a training step (the module docstring says what is assumed)."""
    return breakdown(s, u)[0]


PERSISTENT = ("drafter parameters (fp32)", "AdamW state (2 x fp32)", "DDP gradient buckets", "frozen embed + lm_head",
              "target model (online)", "feature batch (fp32)", "flex block masks")


def peak(s: Shape, u: Setup) -> tuple[float, str]:
    """Peak bytes per GPU (with the allowance and fragmentation) and the phase that sets it."""
    t, change = breakdown(s, u)
    acts = t["activations, checkpointing" if u.checkpointing else "activations, no checkpointing"]
    layer = t["recomputed layer (checkpointing)"] if u.checkpointing else 0
    # held through forward and backward: the compute-dtype weights, earlier micro-batches' gradients
    held = t["FSDP gathered parameters"] + t["autocast weight copies (bf16)"]
    held += t["gradients (fp32)"] if u.grad_accum > 1 else 0
    working = max(t["layer forward working set"], t["layer backward working set"])
    phases = {
        "loss backward": acts + held + t["loss logits buffer"],
        "drafter layers": acts - change["loss side"] + layer + held + working + change["lower layers"],
        "end of backward": t["gradients (fp32)"] + 2 * t["FSDP gathered parameters"],  # + unsharded gradients
        "optimizer step": t["gradients (fp32)"] + t["optimizer step temporaries"],
    }
    phase = max(phases, key=phases.get)
    total = sum(t[k] for k in PERSISTENT) + phases[phase]
    return total * (1 + u.fragmentation) + u.allowance, phase


def max_anchors(s: Shape, u: Setup, budget: float) -> int:
    """The largest num_anchors whose peak fits `budget` bytes (0 if none). Memory grows linearly with
    the anchors but for the loss chunk's cap, so a bisection finds it."""
    fits = lambda n: peak(s, replace(u, num_anchors=n))[0] <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def drafter_shape(drafter, vocab: int, tied: bool = False, target_params: int = 0) -> Shape:
    """The Shape of a DFlashDraftModel on any device, meta included."""
    c, params = drafter.config, list(drafter.parameters())
    return Shape(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                 head_dim=drafter.layers[0].self_attn.head_dim, intermediate=c.intermediate_size,
                 layers=c.num_hidden_layers, block_size=drafter.block_size, vocab=vocab,
                 target_layers=len(drafter.target_layer_ids), params=sum(p.numel() for p in params),
                 layer_params=sum(p.numel() for p in drafter.layers[0].parameters()),
                 largest_param=max(p.numel() for p in params), tied=tied, target_params=target_params,
                 layer_types=tuple(sorted(set(drafter.layer_types))))


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

    from dflash.drafter.build import build_drafter
    from dflash.target.loading import DTYPES, Target

    tcfg, train = job["target"], job["train"]
    text = target_config(tcfg)
    H, V = text.hidden_size, text.vocab_size
    with torch.device("meta"):
        target = Target(model=None, tokenizer=None, config=text, layers=None, final_norm=None,
                        embed_tokens=nn.Embedding(V, H), lm_head=nn.Linear(H, V, bias=False),
                        mask_token_id=tcfg.mask_token_id, path=tcfg.path)
        drafter = build_drafter(job["drafter"], job["layers"], target)
        target_params = 0
        if train.mode == "online":
            from transformers import AutoModelForCausalLM

            target_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(text).parameters())
    shape = drafter_shape(drafter, V, bool(getattr(text, "tie_word_embeddings", False)), target_params)
    setup = Setup(ctx_len=job["max_length"], num_anchors=train.num_anchors, batch=train.batch_size,
                  grad_accum=train.grad_accum,
                  compute=4 if train.mixed_precision == "no" else 2,  # auto is bf16 on a GPU
                  frozen=DTYPES[tcfg.dtype].itemsize, backend="sdpa" if train.attention == "sdpa" else "flex",
                  checkpointing=train.gradient_checkpointing, chunk_logits=job["loss"].chunk_logits,
                  noise=job["noise"].kind != "none", online=train.mode == "online", world=world,
                  distributed=train.distributed, allowance=allowance_gb * GiB, fragmentation=fragmentation)
    return drafter, shape, setup


def make_plan(shape: Shape, setup: Setup, gpu_gb: list[float]) -> dict:
    """Terms, peaks and the largest num_anchors per GPU size, in GiB (what --json prints)."""
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
    return {"shape": asdict(shape), "setup": asdict(setup), "terms_gib": t, "peak": peaks, "gpus": gpus,
            "block_mask_bytes_per_sequence": masks}


def render(plan: dict, drafter, title: str) -> str:
    s, u = plan["shape"], plan["setup"]
    types = ", ".join(f"{t} x{drafter.layer_types.count(t)}" for t in dict.fromkeys(drafter.layer_types))
    head = (f"drafter: {s['layers']} layers ({types}), {s['params'] / 1e9:.3f} B parameters, hidden {s['hidden']}, "
            f"heads {s['heads']}/{s['kv_heads']} x {s['head_dim']}, MLP {s['intermediate']}, block {s['block_size']}, "
            f"fc from {s['target_layers']} target layers; vocab {s['vocab']} ({'tied' if s['tied'] else 'untied'})")
    step = (f"per GPU: {u['batch']} x {u['ctx_len']} context tokens, num_anchors {u['num_anchors']} "
            f"({u['batch'] * u['num_anchors'] * s['block_size']} block tokens), "
            f"{'bf16 autocast' if u['compute'] == 2 else 'float32'}, {u['backend']} attention, "
            f"{'online' if u['online'] else 'offline'}, {u['distributed']} x {u['world']}")
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
    return "\n".join(lines)


def compose(overrides: list[str]) -> dict:
    """The config groups a plan reads, composed from conf/train.yaml like train.py does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from dflash.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=overrides)
    # group by group: the data group may lack what only a real run needs (data.prompts)
    job = {k: OmegaConf.to_object(cfg[k]) for k in ("target", "drafter", "layers", "loss", "noise", "train")}
    return {**job, "max_length": cfg.data.max_length}


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
            opts[key] = type(PLAN_KEYS[key])(value)
        elif arg != "--json":
            overrides.append(arg)
    try:
        drafter, shape, setup = build(compose(overrides), opts["world_size"], opts["allowance_gb"],
                                      opts["fragmentation"])
    except Exception as e:  # a bad override, or a ConfigError (omegaconf wraps those a dataclass check raises)
        cause = next((x for x in (e, e.__cause__, e.__context__) if isinstance(x, (ConfigError, HydraException))), e)
        if cause is e and not isinstance(e, (ConfigError, HydraException)):
            raise
        fail(cause)
    plan = make_plan(shape, setup, opts["gpu_gb"])
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    print(json.dumps(plan, indent=2) if as_json else render(plan, drafter, " ".join(overrides) or "conf/train.yaml"))


if __name__ == "__main__":
    main()
