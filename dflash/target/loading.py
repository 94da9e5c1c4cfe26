"""Loading the target: the model (or just its heads), its tokenizer, device, dtype and kernels.

Every path that needs the target (extraction, online training, evaluation, live decoding)
loads it here, so the model class, dtype, device and kernel backend are chosen one way. The
heads alone are read from the weight files by dflash.target.weights; a built-in target is
built on first use by dflash.target.builtin.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash.config import TargetConfig
from dflash.errors import ConfigError, NotFoundError, TargetError
from dflash.target.builtin import ensure_built
from dflash.target.gguf import check_memory, ensure_dequantized, record as gguf_record
from dflash.target.identity import kernel_backend, kernel_report, weights_fingerprint
from dflash.target.mask import OWN_MODEL, check_mask_token
from dflash.target.quantization import declared, loading_kwargs, record
from dflash.target.scales import IDENTITY, target_scales
from dflash.target.sharding import full_copy, load_sharded
from dflash.target.weights import load_heads, weights_elements

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    """A loaded, frozen target with the pieces a drafter borrows."""

    model: nn.Module | None
    """The causal LM; None when only the heads were loaded (offline training)."""
    tokenizer: object
    config: object
    """The text config (num_hidden_layers, hidden_size, vocab_size, ...)."""
    layers: nn.ModuleList | None
    """The decoder layers, in order."""
    final_norm: nn.Module | None
    embed_tokens: nn.Embedding
    lm_head: nn.Module
    mask_token_id: int
    path: str
    kernels: dict = field(default_factory=dict)
    """Which kernels each layer type runs: see `kernel_report`."""
    fingerprint: str = ""
    """`weights_fingerprint` of the checkpoint files."""
    scales: dict = field(default_factory=lambda: dict(IDENTITY))
    """How it scales its embeddings in and its logits out (dflash.target.scales): what the drafter copies."""
    tp: object | None = None
    """This process's tensor-parallel group when the target is sharded over processes (target.tensor_parallel:
    dflash.target.sharding.TensorParallel), else None."""
    sharding: dict = field(default_factory=lambda: {"tensor_parallel": 1, "expert_parallel": 1, "device_map": None})
    """How the target is laid out over devices, as the manifests record it."""
    quantization: dict | None = None
    """How the checkpoint is quantized and how it ran (dflash.target.quantization.record); None: unquantized."""

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def layer_types(self) -> list[str]:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def tree_verification(self) -> str:
        """How a DDTree is verified in one forward (dflash.drafter.decoding.verify): "sequence" (the nodes after the
        root under an ancestor-only mask: attention-only targets whose attention takes a 4D mask) or "paths"
        (a batch of root-to-leaf paths: hybrid targets, whose recurrent states cannot branch in one sequence,
        and attention implementations that take no custom mask)."""
        impl = getattr(self.model.config, "_attn_implementation", None) if self.model is not None else None
        return "sequence" if not self.is_hybrid and impl in (None, "sdpa", "eager") else "paths"

    def stop_token_ids(self) -> list[int]:
        """The tokenizer's end of turn, Qwen's, and every eos token of the model's generation config (Llama 3.1
        stops at <|eot_id|> and <|end_of_text|>, GPT-OSS at <|return|>, <|call|> and <|endoftext|>)."""
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        for tok in ("<|im_end|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(i for i in ids if i is not None)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"target.device={name} but no CUDA device is visible; use target.device=cpu")
    return torch.device(name)


def _find_layers(model: nn.Module, n: int) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and "Decoder" in type(module[0]).__name__:
            return module
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


def _find_final_norm(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    for owner in model.modules():
        if any(child is layers for child in owner.children()) and hasattr(owner, "norm"):
            return owner.norm
    raise ValueError(f"could not find the final norm of {type(model).__name__}")


def load_target(cfg: TargetConfig, device: torch.device | None = None, heads_only: bool = False) -> Target:
    """Load the target frozen in eval mode, on `device` (default: from cfg.device).

    heads_only: read just `embed_tokens` and `lm_head` from the weight files (all that offline
    training needs), not the whole model.
    """
    from transformers import AutoTokenizer

    path, model_dir, hf_config = read_config(cfg)
    device = device or pick_device(cfg.device)
    common = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    text_config = hf_config.get_text_config()
    if cfg.num_layers is not None and text_config.num_hidden_layers != cfg.num_layers:
        raise ConfigError(f"target.num_layers={cfg.num_layers} (target {cfg.name}) but {path} has "
                          f"{text_config.num_hidden_layers} layers: fix the preset or target.path ({OWN_MODEL})")
    tokenizer = AutoTokenizer.from_pretrained(path, **common)
    dtype = DTYPES[cfg.dtype]
    quantized = declared(hf_config)
    if heads_only and model_dir is not None:
        model, layers, norm = None, None, None
        embed, head = load_heads(model_dir, text_config, dtype, device)
        kernels, scales = {}, target_scales(text_config)
    else:
        tp, sharding = None, {"tensor_parallel": 1, "expert_parallel": 1, "device_map": cfg.device_map}
        if cfg.tensor_parallel > 1:
            model, tp, sharding = load_sharded(path, cfg.name, text_config, cfg.tensor_parallel, dtype,
                                               cfg.attn_implementation, common)
        else:
            if device.type == "cpu" and model_dir is not None and cfg.device_map is None:
                check_memory(weights_elements(model_dir) * dtype.itemsize, f"target {cfg.name} ({model_dir}) "
                                  f"in {cfg.dtype}")
            model = _load_model(path, cfg, dtype, common, device, quantized)
        model.requires_grad_(False).eval()
        layers = _find_layers(model, text_config.num_hidden_layers)
        norm = _find_final_norm(model, layers)
        # what the drafter borrows, whole on every process (a tensor-parallel plan may split them)
        embed, head = full_copy(model.get_input_embeddings()), full_copy(model.get_output_embeddings())
        kernels = kernel_report(model, list(getattr(text_config, "layer_types", None) or []))
        scales = target_scales(text_config, embed)
    check_mask_token(cfg, tokenizer, embed.weight.shape[0], _generation_config(model, path))
    quantization = (record(quantized, model_dir, model) if quantized
                    else gguf_record(model_dir) if model_dir is not None else None)
    target = Target(model=model, tokenizer=tokenizer, config=text_config, layers=layers, final_norm=norm,
                    embed_tokens=embed, lm_head=head, mask_token_id=cfg.mask_token_id, path=path,
                    kernels=kernels, fingerprint=weights_fingerprint(model_dir) if model_dir else "unknown",
                    scales=scales, quantization=quantization)
    if not heads_only:
        target.tp = tp
        target.sharding = sharding
    if (device.type == "cuda" and target.is_hybrid and model is not None
            and target.kernels.get("linear_attention") != "fla" and not cfg.allow_fallback_kernels):
        raise TargetError(
            f"{cfg.name} has linear-attention layers but transformers bound the PyTorch fallback, not the "
            f"fla kernels (install the gpu extra: pip install 'dflash[gpu]'). Features from the fallback "
            f"differ from the ones a server computes. Set target.allow_fallback_kernels=true to accept that")
    log.info("target %s: %d layers, hidden %d, %s on %s%s", cfg.name, target.num_layers, target.hidden_size,
             cfg.dtype, device, f", kernels {kernel_backend(kernels)}" if kernels else " (heads only)")
    return target


def _generation_config(model, path: str):
    """The target's generation config: the loaded model's, else its folder's (heads-only loads); None if none."""
    if model is not None:
        return getattr(model, "generation_config", None)
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None


def as_target(model, tokenizer=None, mask_token_id: int | None = None) -> Target:
    """A Target for a plain loaded HF causal LM (a Target is returned as is)."""
    if isinstance(model, Target):
        return model
    text_config = model.config.get_text_config()
    layers = _find_layers(model, text_config.num_hidden_layers)
    return Target(model=model, tokenizer=tokenizer, config=text_config, layers=layers,
                  final_norm=_find_final_norm(model, layers), embed_tokens=model.get_input_embeddings(),
                  lm_head=model.get_output_embeddings(), mask_token_id=-1 if mask_token_id is None else mask_token_id,
                  path=getattr(model, "name_or_path", ""),
                  kernels=kernel_report(model, list(getattr(text_config, "layer_types", None) or [])),
                  fingerprint="unknown", scales=target_scales(text_config, model.get_input_embeddings()),
                  # a model transformers dequantized at load has dropped its quantization_config: not seen here
                  quantization=record(declared(model.config), None, model) if getattr(model, "is_quantized", False)
                  else None)


def read_config(cfg: TargetConfig) -> tuple[str, Path | None, object]:
    """(where the target's files are, its local folder or None, its config), a built-in target built first.
    Reads config.json only: no weights."""
    from transformers import AutoConfig

    ensure_built(cfg)
    if cfg.gguf is not None:
        ensure_dequantized(cfg.gguf, Path(cfg.path).expanduser())
    model_dir = local_model_dir(cfg.path, cfg.revision)
    path = str(model_dir) if model_dir is not None else cfg.path
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except (OSError, ValueError) as e:
        raise NotFoundError(
            f"cannot load the target config from target.path={cfg.path!r} ({e}). Point target.path at a "
            f"local model directory, or a hub id that is cached locally (HF_HUB_OFFLINE=1 allows no downloads)"
        ) from e
    return path, model_dir, hf_config


def _load_model(path: str, cfg: TargetConfig, dtype: torch.dtype, common: dict, device: torch.device,
                quantized: dict | None = None) -> nn.Module:
    """The causal LM, each weight read from its safetensors file straight to `device`.

    transformers (5.x) builds the model on the meta device and then fills it tensor by tensor: with
    `device_map={"": device}` each tensor goes from the memory-mapped file (cast to `dtype` where the file
    holds another) to `device`, and its host copy is dropped before the next ones, so host memory holds a
    few tensors at a time (the loader's threads), never the model. Without it the model is filled on the
    host and `.to(device)` copies it after: the whole model in host memory on every process (where the
    file's dtype is `dtype`, as pages of the mapped files; otherwise as cast copies in process memory).
    A quantized checkpoint (`quantized`: its quantization_config) loads through transformers' quantizer, checked
    first for the placement (dflash.target.quantization.loading_kwargs).
    """
    from transformers import AutoModelForCausalLM

    # use_kernels=False: from 5.25 on transformers otherwise swaps layers' kernels for ones fetched from the hub
    # (kernelize), a backend the provenance records would not name (and a hub lookup on offline machines).
    # target.device_map: accelerate places the layers over this process's GPUs (a target bigger than one)
    placement = cfg.device_map if cfg.device_map is not None else {"": device}
    extra = loading_kwargs(quantized, placement, cfg.name, path) if quantized else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                                device_map=placement, use_kernels=False, **common, **extra)


def local_model_dir(path: str, revision: str | None = None) -> Path | None:
    """The directory holding a target's files: `path` itself, or its local hub snapshot."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, revision=revision, local_files_only=True))
    except Exception:
        return None
