"""What names a target and how it runs: weights and tokenizer fingerprints, and the kernels
transformers bound for each layer type (fla / causal_conv1d / the PyTorch fallback).

These are the target's side of provenance; `dflash.provenance` puts them into manifests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import torch
from torch import nn

from dflash.errors import NotFoundError


def _resolved_impl(fn) -> tuple[object, tuple | None]:
    """(the implementation transformers bound behind a kernel-dispatching function, the device types it runs
    it on: None for all). transformers 5.25 and later run their PyTorch reference instead of fla's kernels for
    inputs on a device the package does not list (fla: cuda, xpu, mlu, npu; not cpu)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None and fn.__closure__:
            cells = dict(zip(code.co_freevars, fn.__closure__))
            if "implementation" in cells:
                devices = cells["supported_devices"].cell_contents if "supported_devices" in cells else None
                return cells["implementation"].cell_contents, devices
        fn = getattr(fn, "__wrapped__", None)
    return None, None


def kernel_report(model: nn.Module, layer_types: list[str]) -> dict:
    """Which kernels each layer type of the target runs, as will be recorded in manifests.

    `linear_attention` and `causal_conv1d` name the package transformers bound for Gated
    DeltaNet layers (fla / causal_conv1d) or `torch_fallback` for its PyTorch reference code, which is also
    what runs where the package is bound but not used on the model's device (transformers 5.25: fla on CPU).
    """
    report = {"full_attention": getattr(model.config, "_attn_implementation", None) or "eager"}
    if "linear_attention" in layer_types:
        linear = next((m for m in model.modules() if "GatedDeltaNet" in type(m).__name__), None)
        module = sys.modules[type(linear).__module__]
        device = next(model.parameters()).device.type
        for key, fn_name, package in (("linear_attention", "torch_chunk_gated_delta_rule", "fla"),
                                      ("causal_conv1d", "causal_conv1d_fn", "causal_conv1d")):
            impl, devices = _resolved_impl(getattr(module, fn_name, None))
            if impl is None:  # transformers without the dispatch wrapper: infer from the install
                report[key] = package if importlib.util.find_spec(package) else "torch_fallback"
            else:
                bound = getattr(impl, "__module__", "").startswith(package)
                report[key] = package if bound and (devices is None or device in devices) else "torch_fallback"
    if "sliding_attention" in layer_types:
        report["sliding_attention"] = report["full_attention"]
    report.update(_moe_and_sinks(model))
    return report


def moe_experts(text_config) -> tuple[int, int]:
    """(experts, experts a token is routed to) of a mixture-of-experts text config, 0 where the config has none.
    Spellings: num_experts (Qwen, Gemma 4) or num_local_experts (GPT-OSS); num_experts_per_tok (Qwen, GPT-OSS),
    top_k_experts (Gemma 4) or experts_per_token (older GPT-OSS configs)."""
    def first(*keys):
        return int(next((getattr(text_config, k) for k in keys if getattr(text_config, k, None)), 0))

    return (first("num_experts", "num_local_experts"),
            first("num_experts_per_tok", "top_k_experts", "experts_per_token"))


def _moe_and_sinks(model: nn.Module) -> dict:
    """The parts of a mixture-of-experts or attention-sink target that change its hidden states: `moe`, how
    tokens are routed (experts per token of how many, top-k weights renormalised or not; transformers drops
    no token for capacity) and which experts implementation runs them (eager, grouped_mm, batched_mm: their
    sums differ in bf16); `attention_sinks`, learned per-head sink logits (GPT-OSS). Absent for other targets."""
    config, report = model.config.get_text_config(), {}
    experts, top_k = moe_experts(config)
    if experts:
        norm = getattr(config, "norm_topk_prob", None)
        impl = getattr(model.config, "_experts_implementation", None) or "eager"
        report["moe"] = f"top{top_k}of{experts}" + ("" if norm is None else f",norm_topk={str(bool(norm)).lower()}")
        report["moe"] += f",experts={impl}"
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        report["attention_sinks"] = "learned"
    return report


def kernel_backend(report: dict) -> str:
    """One comparable string for a kernel report, e.g. `causal_conv1d=torch_fallback,full_attention=sdpa`."""
    return ",".join(f"{k}={v}" for k, v in sorted(report.items()))


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary, merges, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # canonical JSON (the Rust side writes the vocabulary in hash order, differing run to run),
    # without padding/truncation, which are call-time settings rather than the vocabulary
    spec = json.loads(backend.to_str()) if backend is not None else sorted(tokenizer.get_vocab().items())
    if isinstance(spec, dict):
        spec = {k: v for k, v in spec.items() if k not in ("padding", "truncation")}
    h.update(json.dumps(spec, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over every safetensors file's header (names, dtypes, shapes) and 64 evenly spaced
    4 KiB samples of its data. Reads a few hundred KiB, not the weights, so it is cheap for a
    27B target, yet any fine-tune or re-quantisation changes it."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise NotFoundError(f"{model_dir} has no .safetensors weights to fingerprint")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        with f.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(header_len))
            start = 8 + header_len
            for i in range(64):
                fh.seek(start + (size - start) * i // 64)
                h.update(fh.read(4096))
    return h.hexdigest()[:16]


def target_identity(target) -> dict:
    """What names a target in a manifest: architecture, depth, width, vocab and a weights
    fingerprint (not its path: the same weights may live in different places)."""
    c = target.config
    return {
        "model_type": c.model_type,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "layer_types": target.layer_types,
        "weights_fingerprint": target.fingerprint,
    }
