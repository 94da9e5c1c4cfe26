"""Build a drafter for a target from the typed config (its config.json sized after the target: `drafter_config`),
save and load it in z-lab layout, and check that a drafter fits a target. model.py keeps what an exported
checkpoint runs (with attention.py and dflash2.py, which it imports); the config side is here."""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash.config import DrafterConfig, LayersConfig
from dflash.drafter import attention, dflash2
from dflash.drafter.attention import FULL, SLIDING_RULE, AttentionRule, attention_keys
from dflash.drafter.dflash2 import DFLASH2_KEYS
from dflash.drafter.model import SCALE_KEYS, DFlash2DraftModel, DFlashDraftModel, Scales, is_dflash2
from dflash.drafter.selector_loss import served_weights
from dflash.errors import CheckpointError, ConfigError, NotFoundError
from dflash.io import read_json, write_json
from dflash.layout import CheckpointLayout
from dflash.target.layer_ids import resolve_layer_ids
from dflash.target.loading import Target

log = logging.getLogger(__name__)


def build_drafter(cfg: DrafterConfig, layers: LayersConfig, target: Target,
                  successor_init: str = "normal") -> DFlashDraftModel:
    """A fresh drafter sized after the target (or loaded from cfg.init_from), in float32. successor_init: a fresh
    DFlash 2 selector's successor codebook, normal (the model's init) or zero (loss.selector.init: the pairwise
    term is 0, so it drafts its unary argmax path, DFlash's, until trained; the codebook's gradient P[prev] (W h)
    is not 0, so it trains, and P and W follow once S moves)."""
    layer_ids = resolve_layer_ids(layers, target.num_layers)
    if cfg.init_from:
        drafter = load_trained(cfg.init_from)
        check_fits(drafter, target, source=f"drafter.init_from={cfg.init_from}")
        if drafter.kind != cfg.kind:
            raise ConfigError(f"drafter.init_from={cfg.init_from} is a {drafter.kind} drafter but drafter.kind="
                              f"{cfg.kind}: set drafter.kind={drafter.kind} to fine-tune it (its config.json decides "
                              f"the shape), or start from a {cfg.kind} checkpoint")
        if "sliding_attention" in drafter.layer_types:
            # from here on it trains with the served rule: say so in every checkpoint, or each one would be
            # flagged on load as trained before it (a published drafter's config.json lacks the key)
            drafter.config.dflash_sliding_attention = SLIDING_RULE
        return drafter
    config = drafter_config(
        target.config, num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=layer_ids,
        mask_token_id=target.mask_token_id, layer_types=cfg.resolved_layer_types(),
        sliding_window=cfg.sliding_window, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, dflash2=cfg.dflash2_keys(),
        sliding_causal=cfg.resolved_sliding_causal(), scales=_scales(target))
    drafter = drafter_class(config)(config).float()
    check_fits(drafter, target, source="the drafter config")
    if successor_init == "zero" and drafter.candidate_selector is not None:
        torch.nn.init.zeros_(drafter.candidate_selector.successor_codebook)
    if cfg.init_layers:
        copy_target_layers(drafter, Path(target.path), cfg.init_layers, target.num_layers)
    return drafter


def copy_target_layers(drafter: DFlashDraftModel, folder: Path, ids: list[int], num_layers: int) -> None:
    """drafter.init_layers: drafter layer i starts as target layer ids[i] (its attention and MLP projections, its
    norms; a q_norm/k_norm the target lacks, as Llama's, stays at ones), and the drafter's final norm as the target's,
    read from the target's safetensors files (no model needed: offline training loads the heads only). The drafter
    reads its block with the same kind of layer the target continues text with, so the copy is a start closer to
    predicting the next tokens than a random one (whether it trains faster: docs/results/2026-12-06-real-targets.md)."""
    from safetensors import safe_open

    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"drafter.init_layers={ids}: {bad} outside the target's layers [0, {num_layers})")
    wanted = {f"layers.{layer}.": f"layers.{i}." for i, layer in enumerate(ids)}
    own = drafter.state_dict()
    copied, misfit = set(), []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith(("mtp.", "model.visual.", "visual.")):
                    continue
                mine = "norm.weight" if name.endswith("model.norm.weight") or name == "norm.weight" else None
                for theirs, ours in wanted.items():
                    at = name.find(theirs)
                    if at >= 0 and (at == 0 or name[at - 1] == "."):
                        mine = ours + name[at + len(theirs):]
                if mine is None or mine not in own:
                    continue
                tensor = fh.get_tensor(name)
                if tensor.shape != own[mine].shape:
                    misfit.append(f"{name} {tuple(tensor.shape)} vs drafter {mine} {tuple(own[mine].shape)}")
                    continue
                with torch.no_grad():
                    own[mine].copy_(tensor.to(own[mine].dtype))
                copied.add(mine)
    if misfit:
        raise ConfigError(f"drafter.init_layers={ids}: the target's layers do not fit the drafter's ({misfit[0]}); "
                          f"leave the drafter's width, heads and MLP to the target's (drafter.head_dim, "
                          f"num_attention_heads, intermediate_size null) or set drafter.init_layers=null")
    empty = [i for i in range(len(ids)) if not any(k.startswith(f"layers.{i}.") for k in copied)]
    if empty:
        raise ConfigError(f"drafter.init_layers={ids}: no weights of target layer {ids[empty[0]]} found in {folder}")
    log.info("drafter layers initialised from target layers %s (%d tensors)", ids, len(copied))


def use_conv_kernel(drafter: torch.nn.Module, setting: str, device: torch.device, compiled: bool = False) -> str:
    """DFlash 2's convolutions in `drafter` run through `setting` (train.conv_kernel): torch, triton (refused, with
    the reason, where the kernels cannot run) or auto (triton where they can, else torch). Returns the kernel now in
    use; a drafter without convolutions (DFlash) keeps the setting as given. compiled (train.compile): auto keeps the
    torch path, which inductor fuses; the kernels under dynamo are not checked yet (no GPU run has)."""
    convs = [m for m in drafter.modules() if isinstance(m, dflash2.GroupedDynamicConv)]
    if not convs or setting == "torch":
        return setting
    why_not = _conv_kernel_blocker(convs[0].group_size, device)
    if setting == "auto" and compiled and not why_not:
        why_not = "train.compile is on: inductor fuses the torch path"
    if setting == "triton" and why_not:
        raise _conv_kernel_refused(why_not)
    if why_not:
        log.info("train.conv_kernel=auto: torch (%s)", why_not)
        return "torch"
    from dflash.drafter import conv_kernel  # here: it imports triton, which only a CUDA machine has

    for conv in convs:
        conv.conv = conv_kernel.grouped_dynamic_conv
    log.info("train.conv_kernel=%s: DFlash 2's convolutions run as Triton kernels on %s", setting, device)
    return "triton"


def check_conv_kernel(cfg: DrafterConfig, setting: str, device: torch.device) -> None:
    """train.conv_kernel=triton for a DFlash 2 drafter refused before any work (data, extraction) where the kernels
    cannot run on `device`; `use_conv_kernel` applies the setting once the drafter is built."""
    why_not = _conv_kernel_blocker(cfg.conv_group_size, device) if setting == "triton" and cfg.kind == "dflash2" \
        else None
    if why_not:
        raise _conv_kernel_refused(why_not)


def _conv_kernel_refused(why_not: str) -> ConfigError:
    return ConfigError(f"train.conv_kernel=triton cannot run here: {why_not}; set train.conv_kernel=torch (or auto)")


def _conv_kernel_blocker(group_size: int, device: torch.device) -> str | None:
    """Why the Triton convolution cannot run for this drafter on `device`, or None. Triton's interpreter
    (TRITON_INTERPRET=1) runs it on the CPU, as the engines check does."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with torch's CUDA builds)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the kernels run on CUDA and the drafter trains on {device.type}"
    if group_size & (group_size - 1):
        return f"conv_group_size={group_size} is not a power of two"
    return None


def base_value(config, name: str, default=None):
    """config.<name>, or where transformers keeps per-layer values of it (Gemma 4's full-attention layers have
    their own head width and key/value heads, and reading the global one raises) the value the other layers
    share, which is what config.json states at the top level."""
    try:
        return getattr(config, name, default)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return config.to_dict().get(name, default)


SCALED_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")
"""Rope types whose scaling a drafter copies from its target (what its positions mean at long context)."""


def drafter_rope(target_config) -> dict:
    """The drafter's rope: the target's theta, and its scaling where it has one (Llama 3.1's llama3, GPT-OSS's
    yarn; the published gpt-oss drafters carry the target's yarn). Not its partial rotary factor or multimodal
    sections (Qwen3.5's drafters rotate whole heads). Gemma 4 keeps a rope per layer type: its full-attention
    layers' theta (1e6, the published Gemma 4 drafters')."""
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type
        rope = dict(rope["full_attention"])
    theta = float(rope.get("rope_theta") or getattr(target_config, "rope_theta", None) or 1_000_000.0)
    if rope.get("rope_type") not in SCALED_ROPE:
        return {"rope_type": "default", "rope_theta": theta}
    return {k: v for k, v in {**rope, "rope_theta": theta}.items()
            if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}


def drafter_config(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    dflash2: dict | None = None,
    sliding_causal: bool = True,
    scales: Scales = Scales(),
) -> Qwen3Config:
    """A z-lab drafter config sized after a target's text config (any Qwen-style model).

    dflash2: {conv_kernel_size, conv_group_size, selector_rank, selector_top_k} makes a DFlash 2 config
    (architectures DFlash2DraftModel, those keys and block_size in dflash_config, as published).
    sliding_causal: whether sliding_attention layers are causal inside the block (full_attention layers never
    are). The attention keys every server reads (is_causal, dflash_config.causal/use_swa/swa_window_size) are
    written explicitly (`attention_keys`). scales: the target's (dflash.target.scales), written into dflash_config
    where they are not the identity."""
    base = lambda name, default=None: base_value(target_config, name, default)  # noqa: E731
    heads = num_attention_heads or base("num_attention_heads")
    types = list(layer_types) if layer_types else ["full_attention"] * num_layers
    dflash = {"target_layer_ids": list(target_layer_ids), "mask_token_id": int(mask_token_id)}
    if dflash2:
        dflash.update({k: int(dflash2[k]) for k in DFLASH2_KEYS}, block_size=int(block_size))
    rules = [AttentionRule(sliding_causal, sliding_window) if t == "sliding_attention" else FULL for t in types]
    keys = attention_keys(rules)
    dflash.update(keys.pop("dflash_config"), **scales.keys())
    return Qwen3Config(
        architectures=["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        # a target with no dense MLP (Qwen3.5/3.6 MoE): 3 x hidden, the published Qwen3.6-35B-A3B drafter's width
        intermediate_size=intermediate_size or base("intermediate_size") or 3 * target_config.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or base("num_key_value_heads"),
        head_dim=head_dim or base("head_dim") or target_config.hidden_size // heads,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=drafter_rope(target_config),
        attention_bias=bool(getattr(target_config, "attention_bias", False)),
        tie_word_embeddings=False,
        use_sliding_window="sliding_attention" in types,
        sliding_window=sliding_window,
        max_window_layers=num_layers,
        layer_types=types,
        block_size=block_size,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config=dflash,
        **keys,
        **scales.keys(),
        **({"dflash_sliding_attention": SLIDING_RULE} if "sliding_attention" in types else {}),
    )


def _scales(target) -> Scales:
    """The target's Scales (dflash.target.scales; the identity for a stand-in without them)."""
    return Scales(**getattr(target, "scales", None) or {})


def drafter_class(config) -> type[DFlashDraftModel]:
    """DFlash2DraftModel for a DFlash 2 config (the class name its exports carry), else DFlashDraftModel."""
    return DFlash2DraftModel if is_dflash2(config) else DFlashDraftModel


def load_drafter(path: str) -> DFlashDraftModel:
    """Load a drafter directory in z-lab layout, with a clear error for what is missing."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise NotFoundError(f"drafter directory {path} does not exist")
    missing = [f for f in ("config.json",) if not (root / f).exists()]
    if not any(root.glob("*.safetensors")):
        missing.append("model.safetensors")
    if missing:
        raise NotFoundError(f"drafter directory {path} is missing {', '.join(missing)}; it is not a "
                                f"complete drafter in z-lab layout (config.json + model.safetensors)")
    try:
        # the class from the plain JSON: a generic PretrainedConfig would validate rope scaling (yarn, llama3)
        # against keys only the drafter's Qwen3Config has
        drafter = drafter_class(SimpleNamespace(**read_json(root / "config.json"))).from_pretrained(str(root))
    except ValueError as e:  # the strict load names the weights that do not match config.json; config checks
        raise CheckpointError(str(e) if str(root) in str(e) else f"{root}/config.json: {e}") from e
    except Exception as e:  # safetensors and json errors name neither the file nor the drafter
        raise CheckpointError(f"cannot load the drafter in {root} ({type(e).__name__}: {str(e)[:200]}); a file there "
                              f"is truncated or corrupt. Use another checkpoint (e.g. checkpoint=step<N>) or "
                              f"re-export this one") from e
    if ("sliding_attention" in drafter.layer_types and getattr(drafter.config, "dflash_sliding_attention", None)
            != SLIDING_RULE and CheckpointLayout(root).manifest.exists()):
        log.warning("drafter %s was trained by dflash before its sliding-attention layers followed the served rule "
                    "(causal inside the block, DESIGN §2): it attended both ways inside the block, so SGLang/vLLM "
                    "serve it differently from how it was trained. Retrain it, or evaluate it knowing that", root)
    return drafter


SHRINK_KEY = "selector_shrink"
"""dflash_config key of a DFlash 2 checkpoint written by dflash: the factor its served predecessor codebook carries
(loss.selector.shrink), i.e. model.safetensors holds the trained codebook times it. Servers ignore it (they serve
the weights as they are); dflash reads it to train on from the trained codebook (`load_trained`)."""


def load_trained(path: str, weights: dict | None = None) -> DFlashDraftModel:
    """The drafter in `path` as training continues from it (drafter.init_from, train.resume), in float32: its trained
    weights, which for a DFlash 2 checkpoint of dflash are not the served ones (`SHRINK_KEY`). They are `weights`
    where given (a resume has read train_state/'s float32 copy already), else that copy where the folder has one,
    else the served weights with the predecessor codebook divided by the recorded shrink. A drafter without the key
    (a published one, or dflash's from before it) is taken as it is: its served weights are all there is. Taking
    the served codebook as the trained one would shrink it again at the next save (0.36 x, not 0.6 x)."""
    drafter = load_drafter(path).float()
    dflash = getattr(drafter.config, "dflash_config", None) or {}
    shrink = dflash.pop(SHRINK_KEY, None)  # the module now holds trained weights: a re-export records its own
    exact = CheckpointLayout(Path(path).expanduser()).state_file(CheckpointLayout.EXACT_WEIGHTS)
    if weights is None and exact.exists():
        try:
            weights = load_file(str(exact))
        except Exception as e:
            raise CheckpointError(f"cannot read {exact} ({e}); it is corrupt. Delete train_state/ to start from the "
                                  f"served weights in {path}, or use another checkpoint") from e
    if weights is not None:
        try:
            drafter.load_state_dict(weights)
        except RuntimeError as e:
            raise CheckpointError(f"the float32 weights in {exact} do not fit {path}/config.json ({str(e)[:300]}); "
                                  f"delete train_state/ to start from the served weights, or use another "
                                  f"checkpoint") from e
        return drafter
    if shrink is not None and float(shrink) != 1.0 and drafter.candidate_selector is not None:
        if not float(shrink) > 0:
            raise CheckpointError(f"{path}/config.json records dflash_config.{SHRINK_KEY}={shrink}: its served "
                                  f"predecessor codebook is 0, and the trained one is only in train_state/, which "
                                  f"this folder lacks. Start from the checkpoint with its train_state/")
        with torch.no_grad():
            drafter.candidate_selector.predecessor_codebook.div_(float(shrink))
        log.info("%s has no train_state/: training starts from its served weights, the predecessor codebook divided "
                 "by the dflash_config.%s=%s they carry", path, SHRINK_KEY, shrink)
    return drafter


MODELING_FILE = "modeling_dflash.py"
IMPORTED_FILES = {"dflash2.py": dflash2, "attention.py": attention}  # what the model file imports (relative)


def save_drafter(drafter: DFlashDraftModel, folder: Path, state_dict: dict | None = None,
                 dtype: torch.dtype | None = None, selector_shrink: float | None = None) -> None:
    """The drafter in z-lab layout, loadable wherever published DFlash drafters load: model.safetensors,
    config.json with both spellings of the rope and dtype keys (transformers 5's rope_parameters/dtype,
    and rope_theta/rope_scaling/torch_dtype that older readers take), and this package's model.py as
    modeling_dflash.py with `auto_map`, so AutoModel.from_pretrained(folder, trust_remote_code=True)
    builds a DFlashDraftModel. `dtype` casts the saved floating-point weights (e.g. bf16 for serving).
    selector_shrink (DFlash 2, loss.selector.shrink): the weights given are the trained ones; the predecessor
    codebook is saved times it (`served_weights`) and config.json records it (`SHRINK_KEY`), so the two never
    disagree. None: the weights are saved as given, and config.json says what the drafter's own config says."""
    folder = Path(folder)
    shrink = selector_shrink if drafter.candidate_selector is not None else None
    if shrink is not None:
        state_dict = served_weights(state_dict if state_dict is not None else drafter.state_dict(), shrink)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in (state_dict if state_dict is not None else drafter.state_dict()).items()}
    name = "DFlash2DraftModel" if drafter.kind == "dflash2" else "DFlashDraftModel"
    drafter.config.architectures = [name]
    drafter.config.auto_map = {"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.{name}"}
    drafter.save_pretrained(folder, state_dict=state_dict)
    shutil.copyfile(inspect.getsourcefile(DFlashDraftModel), folder / MODELING_FILE)  # pure: torch + transformers
    for file, module in IMPORTED_FILES.items():
        shutil.copyfile(inspect.getsourcefile(module), folder / file)
    config = read_json(folder / "config.json")
    config["architectures"] = [name]  # save_pretrained writes the Python class's name
    rope = dict(config.get("rope_parameters") or {})
    config["rope_theta"] = rope.get("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = config.get("dtype")
    if shrink is not None:
        config["dflash_config"][SHRINK_KEY] = float(shrink)
    write_json(folder / "config.json", config, indent=2)


def check_fits(drafter: DFlashDraftModel, target: Target, source: str = "the drafter") -> None:
    """Refuse a drafter whose width, layer ids or mask token do not fit the target."""
    c = drafter.config
    if c.hidden_size != target.hidden_size:
        raise ConfigError(f"{source} has hidden size {c.hidden_size} but the target has {target.hidden_size}; "
                          f"a drafter only fits the target family it was built for")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"{source} reads target layers {bad}, outside this {target.num_layers}-layer target")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ConfigError(f"{source} uses mask token {drafter.mask_token_id}, outside the target's "
                          f"vocabulary of {target.vocab_size}")
    theirs = _scales(target)
    for key in SCALE_KEYS:
        if getattr(drafter.scales, key) != getattr(theirs, key):
            # a drafter's scales are part of how it was trained (published Gemma 4 drafters embed unscaled rows
            # and cap at 30): it is evaluated and served with its own, as its config.json states them
            log.warning("%s has %s=%s, the target %s %s: it runs with its own value, as servers read it from its "
                        "config.json (a drafter built by dflash copies the target's)", source, key,
                        getattr(drafter.scales, key), target.path, getattr(theirs, key))
    if getattr(c, "num_target_layers", target.num_layers) != target.num_layers:
        log.warning("%s was built for a %s-layer target; this target has %d layers", source,
                    c.num_target_layers, target.num_layers)
