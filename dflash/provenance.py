"""Provenance: what made a set of features, written into every manifest and checked everywhere.

A drafter trained on fla-computed states and evaluated on PyTorch-fallback states looks broken;
a cache resumed with another configuration mixes two kinds of features. This module is the one
place that says what a manifest holds (`features_manifest`, DESIGN §3), which fields must agree
for what (`GUARDED_FIELDS`, `RESUME_FIELDS`), and checks them (`check_*`), for extraction,
offline and resumed training, in-run and offline evaluation and live decoding.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time

import torch

from dflash.errors import CacheError, ConfigError, ProvenanceError
from dflash.target.identity import kernel_backend, target_identity, tokenizer_fingerprint
from dflash.target.quantization import signature
from dflash.target.sharding import EXACT_FAMILIES

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the feature-cache format (shards and manifest)."""

GUARDED_FIELDS = ("target", "tokenizer", "layer_ids", "dtype", "kernel_backend", "layout", "quantized")
"""Fields that must agree between a drafter's training features and the features it is evaluated
or resumed on; each may be waived knowingly with provenance.allow_mismatch=[...]."""

RESUME_FIELDS = ("format_version", "target", "tokenizer", "layer_ids", "dtype", "storage", "kernel_backend",
                 "layout", "quantized", "data", "max_length", "shard_sequences", "topk_logits")
"""Fields that must agree for an unfinished cache to be resumed by another extraction."""


def check_allowed(allow_mismatch: list[str]) -> None:
    """provenance.allow_mismatch may only name guarded fields."""
    for name in allow_mismatch:
        if name not in GUARDED_FIELDS:
            raise ConfigError(f"provenance.allow_mismatch[*]={name!r} is not valid; expected one of "
                              f"{sorted(GUARDED_FIELDS)}")


def library_versions() -> dict:
    out = {}
    for dist in ("dflash-train", "torch", "transformers", "flash-linear-attention", "causal-conv1d"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def backend_report(target) -> dict:
    """Which kernels each layer type ran, on which device and dtype, with which libraries."""
    return {
        "kernels": dict(target.kernels),
        "kernel_backend": kernel_backend(target.kernels),
        "device": str(target.device) if target.device.type == "cpu" else torch.cuda.get_device_name(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "versions": library_versions(),
    }


def target_signature(target) -> dict:
    """What features depend on besides layers and kernels: the weights, tokenizer and dtype
    (available from the heads alone, so offline training can check a cache without the model)."""
    return {"target": target_identity(target), "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "dtype": str(target.dtype).removeprefix("torch.")}


def layout(target) -> str | None:
    """What the target's sharding makes of its features, as a guarded field: None (absent from the manifest) for
    features equal to the unsharded target's: unsharded, placed over GPUs (the same computation, device by
    device), or tensor parallel in a family whose equality the tests hold (dflash.target.sharding.EXACT_FAMILIES);
    else a name that keeps them apart (refused beside unsharded ones unless provenance.allow_mismatch=[layout])."""
    size = target.sharding.get("tensor_parallel", 1)
    family = getattr(target.config, "model_type", "?")
    if size <= 1 or family in EXACT_FAMILIES:
        return None
    return f"tensor_parallel={size} ({family}: not verified equal to the unsharded target)"


def quantized(target) -> str | None:
    """What a quantized target's quantization makes of its features, as a guarded field: None (absent from the
    manifest, as in manifests made before quantized targets were) for an unquantized target; else its format, bits
    and how it ran (`mxfp4, 4-bit, dequantized at load`), which keeps them apart from an unquantized target's and
    from the same checkpoint's run another way (refused unless provenance.allow_mismatch=[quantized])."""
    return signature(getattr(target, "quantization", None))


def features_manifest(target, layer_ids: list[int], storage: str, max_length: int, data_info: dict,
                      shard_sequences: int, topk_logits: int = 0) -> dict:
    """The provenance manifest of features computed now by `target` (DESIGN §3). topk_logits: k > 0 when the
    shards also hold the target's top-k next-token log-probabilities (the key is absent otherwise, as in
    caches made before it existed). `sharding` records how the target was laid out over devices; `layout` (only
    where the sharding makes features other than the unsharded target's: `layout()`) is guarded. `quantization` records the checkpoint's quantization
    (dflash.target.quantization.record; None: unquantized); `quantized` (only for a quantized target) is guarded."""
    report = backend_report(target)
    kept, quant = layout(target), quantized(target)
    return {
        **({"topk_logits": topk_logits} if topk_logits else {}),
        **({"layout": kept} if kept else {}),
        **({"quantized": quant} if quant else {}),
        "sharding": dict(target.sharding),
        "quantization": getattr(target, "quantization", None),
        "format_version": FORMAT_VERSION,
        **target_signature(target),
        "target_path": target.path,
        "layer_ids": list(layer_ids),
        "hidden_size": target.hidden_size,
        "storage": storage,
        "kernel_backend": report["kernel_backend"],
        "kernels": report["kernels"],
        "device": report["device"],
        "versions": report["versions"],
        "data": {k: v for k, v in data_info.items() if k != "completions"},
        "completions_path": data_info.get("completions"),
        "max_length": max_length,
        "shard_sequences": shard_sequences,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def generation_settings(target, completions, chat_template: bool, enable_thinking: bool,
                        template_kwargs: dict | None = None) -> dict:
    """What a stored completion depends on; a completions store made with other values is refused."""
    return {"target": target.fingerprint, "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "max_new_tokens": completions.max_new_tokens, "chat_template": chat_template,
            "enable_thinking": enable_thinking, "stop": list(completions.stop),
            **({"chat_template_kwargs": dict(template_kwargs)} if template_kwargs else {}),
            **({"temperature": completions.temperature, "top_p": completions.top_p, "top_k": completions.top_k,
                "seed": completions.seed} if completions.temperature > 0 else {})}


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 300 else text[:297] + "..."


def differences(there: dict, now: dict) -> str:
    """`key: <there> there, <now> now` for each key of either dict whose values differ, comma-separated."""
    return ", ".join(f"{k}: {there.get(k)!r} there, {now.get(k)!r} now"
                     for k in {**now, **there} if there.get(k) != now.get(k))


def check_provenance(expected: dict, actual: dict, allow: list[str] | tuple = (), *,
                     expected_name: str = "the checkpoint", actual_name: str = "the features",
                     fields: tuple = GUARDED_FIELDS) -> list[str]:
    """Compare the guarded fields of two manifests.

    Raises ProvenanceError naming every differing field that is not in `allow`, with both
    values and the override. Returns the allowed fields that differed (logged as warnings)
    so callers can record them. `fields` narrows the check to what `expected` knows.
    """
    differing = [f for f in fields if expected.get(f) != actual.get(f)]
    refused = [f for f in differing if f not in allow]
    if refused:
        lines = [f"  {f}: {_show(expected.get(f))} in {expected_name}, {_show(actual.get(f))} in {actual_name}"
                 for f in refused]
        raise ProvenanceError(
            f"{actual_name} do not match {expected_name}:\n" + "\n".join(lines) +
            f"\nRe-extract the features with the same target/kernels, or, if you know the difference is "
            f"harmless, override with provenance.allow_mismatch=[{','.join(refused)}]")
    for f in differing:
        log.warning("provenance: %s differs and is allowed by provenance.allow_mismatch: %s in %s, %s in %s",
                    f, _show(expected.get(f)), expected_name, _show(actual.get(f)), actual_name)
    return differing


def check_resumable(old: dict, new: dict, root) -> None:
    """An unfinished cache at `root` (manifest `old`) may only be continued by the same configuration."""
    diff = [f for f in RESUME_FIELDS if old.get(f) != new.get(f)]
    if diff:
        lines = "; ".join(f"{f}: cache has {json.dumps(old.get(f))[:200]}, this run has "
                          f"{json.dumps(new.get(f))[:200]}" for f in diff)
        raise CacheError(f"features.dir={root} holds features made with another configuration ({lines}). "
                         f"Set features.dir to a new directory, or delete {root} to rebuild it")


def check_kernels(manifest: dict, target, root) -> None:
    """Features at `root` must come from the kernels the loaded target runs now (when it runs any)."""
    now = kernel_backend(target.kernels) if target.kernels else None
    if now is not None and manifest["kernel_backend"] != now:
        raise CacheError(f"held-out features in {root} were made with kernels {manifest['kernel_backend']}"
                         f" but the target now runs {now}; delete {root} to recompute them with these kernels")


def check_trained_on(trained_on: dict | None, features: dict, allow: list[str], label: str, what: str,
                     source) -> list[str]:
    """The guard at evaluation: `features` must match what drafter `label` (at `source`) was trained on.
    A drafter without a training manifest (not trained by dflash) cannot be checked: a warning."""
    if trained_on is None:
        log.warning("drafter %s carries no training manifest (not trained by dflash): provenance of its features "
                    "cannot be checked", source)
        return []
    return check_provenance(trained_on, features, allow, expected_name=f"drafter {label}'s training features",
                            actual_name=what)


def live_features(target, layer_ids: list[int]) -> dict:
    """The manifest fields of features the live target computes right now."""
    kept, quant = layout(target), quantized(target)
    return {**target_signature(target), "layer_ids": list(layer_ids), "kernel_backend": kernel_backend(target.kernels),
            **({"layout": kept} if kept else {}), **({"quantized": quant} if quant else {})}
