"""Build training sequences (prompts + target completions) and extract their features into a
provenance-stamped cache, resumable shard by shard, split across processes."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash import cache as fcache
from dflash.completions import completion_ids, obtain, text_sha
from dflash.config import DataConfig, FeaturesConfig, JobConfig
from dflash.data import Sequence, build_sequence, encode, load_prompts, prompt_text, prompts_hash
from dflash.dist import Dist
from dflash.features import backend_report, batched_features
from dflash.target import Target, load_target, resolve_layer_ids, target_identity, tokenizer_fingerprint

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    sequences: list[Sequence]
    info: dict
    """What the sequences were made from: sources, hashes, counts of what was skipped."""


def default_completions_path(data: DataConfig, features: FeaturesConfig) -> Path:
    return Path(data.completions.path) if data.completions.path else Path(features.dir).parent / "completions.jsonl"


def generation_settings(data: DataConfig, target: Target) -> dict:
    """What a stored completion depends on; a store made with other values is refused."""
    return {"target": target.fingerprint, "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "max_new_tokens": data.completions.max_new_tokens, "chat_template": data.chat_template,
            "enable_thinking": data.enable_thinking, "stop": list(data.completions.stop)}


def prepare_sequences(data: DataConfig, target: Target, store: Path, dist: Dist, prompts_spec: str | None = None,
                      max_new_tokens: int | None = None, limit: int | None = None) -> Prepared:
    """Prompts -> chat text -> target completions -> token sequences with a response loss mask.

    Prompts that leave no room for a response within data.max_length are skipped and counted,
    as are prompts without a completion (source=cached).
    """
    spec = prompts_spec or data.prompts
    prompts = load_prompts(spec, data.format, data.split, data.prompt_key, data.offset,
                           limit if limit is not None else data.limit)
    texts = [prompt_text(target.tokenizer, p, data.chat_template, data.enable_thinking) for p in prompts]
    ids = [encode(target.tokenizer, t) for t in texts]
    fits = [i for i in range(len(prompts)) if len(ids[i]) + 2 <= data.max_length]
    skipped = {"prompt_too_long": len(prompts) - len(fits), "no_completion": 0, "completion_too_short": 0}
    if skipped["prompt_too_long"]:
        log.warning("skipping %d of %d prompts longer than data.max_length=%d tokens",
                    skipped["prompt_too_long"], len(prompts), data.max_length)
    comp_cfg = data.completions
    if max_new_tokens is not None:
        from dataclasses import replace

        comp_cfg = replace(comp_cfg, max_new_tokens=max_new_tokens)
    settings = generation_settings(data, target) | {"max_new_tokens": comp_cfg.max_new_tokens}
    records = obtain(comp_cfg, store, [(prompts[i].id, texts[i]) for i in fits], settings, dist,
                     target=target, model=comp_cfg.model or str(target.path),
                     eos_id=target.tokenizer.convert_tokens_to_ids("<|im_end|>") if target.tokenizer else None)
    sequences = []
    for i in fits:
        rec = records.get(prompts[i].id)
        if rec is None or rec.get("prompt_sha") not in (None, text_sha(texts[i])):
            skipped["no_completion"] += 1
            continue
        seq = build_sequence(prompts[i].id, ids[i], completion_ids(rec, target.tokenizer), data.max_length)
        if seq is None:
            skipped["completion_too_short"] += 1
            continue
        sequences.append(seq)
    if skipped["no_completion"]:
        log.warning("%d prompts have no completion in %s and are skipped", skipped["no_completion"], store)
    if not sequences:
        raise ValueError(f"no training sequences from {spec} (skipped: {skipped}); check data.prompts, "
                         f"data.max_length and the completions in {store}")
    comp_hash = hashlib.sha256(
        "".join(f"{s.id}:{s.input_ids.tolist()}" for s in sequences).encode()).hexdigest()[:16]
    info = {"prompts": spec, "prompts_sha256": prompts_hash(prompts), "completions": str(store),
            "sequences_sha256": comp_hash, "num_prompts": len(prompts), "num_sequences": len(sequences),
            "skipped": skipped}
    return Prepared(sequences, info)


def target_signature(target: Target) -> dict:
    """What features depend on besides layers and kernels: the weights, tokenizer and dtype
    (available from the heads alone, so offline training can check a cache without the model)."""
    return {"target": target_identity(target), "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "dtype": str(target.dtype).removeprefix("torch.")}


def features_manifest(target: Target, layer_ids: list[int], storage: str, max_length: int, data_info: dict,
                      shard_sequences: int) -> dict:
    """The provenance manifest of features computed now by `target` (DESIGN §3)."""
    report = backend_report(target)
    return {
        "format_version": fcache.FORMAT_VERSION,
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


def write_cache(features: FeaturesConfig, target: Target, layer_ids: list[int], prepared: Prepared,
                manifest: dict, dist: Dist) -> dict:
    """Extract every shard not yet on disk (this process's share), then finalize on the main process."""
    from tqdm import tqdm

    root = Path(features.dir)
    seqs = prepared.sequences
    size = features.shard_sequences
    num_shards = math.ceil(len(seqs) / size)
    if dist.is_main:
        fcache.open_for_writing(root, manifest)
    dist.barrier()
    done = fcache.done_shards(root)
    mine = [k for k in range(num_shards) if k % dist.world == dist.rank and k not in done]
    tokens = sum(s.input_ids.numel() for k in mine for s in seqs[k * size:(k + 1) * size])
    if done:
        log.info("cache %s: %d of %d shards already written; resuming", root, len(done), num_shards)
    log.info("process %d of %d extracts shards %s", dist.rank, dist.world, mine)
    bar = tqdm(total=tokens, desc=f"extract[{dist.rank}]", unit="tok", unit_scale=True, disable=None)
    for k in mine:
        part = seqs[k * size:(k + 1) * size]
        feats: list[torch.Tensor | None] = [None] * len(part)
        for i, f in batched_features(target, [s.input_ids for s in part], layer_ids, features.batch_tokens):
            feats[i] = f.cpu()
            bar.update(part[i].input_ids.numel())
        fcache.write_shard(root, k, [s.id for s in part], [s.input_ids for s in part],
                           [s.loss_mask for s in part], feats, features.storage, len(layer_ids))
    bar.close()
    dist.barrier()
    if dist.is_main:
        manifest = fcache.finalize(root, num_shards)
    dist.barrier()
    return fcache.read_manifest(root)


def cache_is_complete(features: FeaturesConfig) -> bool:
    path = Path(features.dir) / "manifest.json"
    return path.exists() and fcache.read_manifest(Path(features.dir)).get("complete", False)


def extract_with(job: JobConfig, target: Target, dist: Dist) -> dict:
    """Prepare the sequences and write the cache with an already-loaded target."""
    layer_ids = resolve_layer_ids(job.layers, target.num_layers)
    store = default_completions_path(job.data, job.features)
    prepared = prepare_sequences(job.data, target, store, dist)
    manifest = features_manifest(target, layer_ids, job.features.storage, job.data.max_length, prepared.info,
                                 job.features.shard_sequences)
    return write_cache(job.features, target, layer_ids, prepared, manifest, dist)


def extract(job: JobConfig) -> dict:
    """extract.py: completions, then features, into job.features.dir."""
    from dflash import dist as dist_mod
    from dflash.runlog import setup_logging

    setup_logging()
    dist = dist_mod.current()
    target = load_target(job.target)
    t0 = time.time()
    manifest = extract_with(job, target, dist)
    if dist.is_main:
        log.info("cache %s: %d sequences, %d tokens, %s features in %d shards (%.0f s)", job.features.dir,
                 manifest["num_sequences"], manifest["num_tokens"], manifest["storage"], len(manifest["shards"]),
                 time.time() - t0)
    return manifest
