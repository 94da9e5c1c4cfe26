"""Feature extraction: the target runs over prepared sequences and their features go into a
provenance-stamped cache, resumable shard by shard, split across processes.

`extract_features` is the one API: training data (extract.py, or offline training when its
cache is missing) and the held-out set (dflash.evaluate.heldout) both call it with what they
prepared. `extract(job)` is extract.py's job: the training data of `job`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash import dist as dist_mod
from dflash.config import ConfigError, DataConfig, FeaturesConfig, JobConfig
from dflash.config.data import rounds, storage_for
from dflash.data import cache as fcache
from dflash.data.mixture import merge, source_store, sources_of
from dflash.data.prompts import Prompt, load_prompts
from dflash.data.sequences import Prepared, prepare_sequences
from dflash.data.vllm_features import extract_features_vllm
from dflash.dist import Dist
from dflash.provenance import features_manifest
from dflash.target.features import TopK, batched_features
from dflash.target.layer_ids import resolve_layer_ids
from dflash.target.loading import Target, load_target
from dflash.target.sharding import drain
from dflash.tracking import setup_logging

log = logging.getLogger(__name__)


def cache_storage(storage: str, target: Target, dest: Path, dist: Dist) -> str:
    """features.storage as the cache at `dest` stores it (resolved here, once per extraction; the config keeps what
    the user wrote). auto is the target's dtype, unless a cache at `dest` was begun or made with another storage:
    that one is kept, so that a cache made under the former default (bfloat16, also for float32 targets) is resumed
    and reused as it is rather than refused or extracted again (the warning below says what it costs). An explicit
    storage is what it says (a cache begun with another is refused, naming both: check_resumable)."""
    dtype = str(target.dtype).removeprefix("torch.")
    chosen = storage_for(storage, dtype)
    if storage == "auto":
        chosen = fcache.recorded_storage(dest) or chosen
    if dist.is_main and rounds(chosen, dtype):
        log.warning(rounding_warning(dest, chosen, dtype))
    return chosen


def rounding_warning(dest: Path, storage: str, dtype: str) -> str:
    """One line: the drafter trains on features rounded to `storage` while evaluation and serving see the target's."""
    return (f"feature cache {dest}: the {dtype} target's features are stored in {storage}, so the drafter trains on "
            f"rounded features while evaluation and serving see the target's own; features.storage=auto (or {dtype}) "
            f"in a new features.dir stores them exactly")


def extract_features(target: Target, layer_ids: list[int], prepared: Prepared, dest: Path, dist: Dist, *,
                     storage: str, shard_sequences: int, batch_tokens: int, max_length: int | None,
                     topk_logits: int = 0) -> dict:
    """Features of `prepared` (layers `layer_ids`) into the cache at `dest`: every shard not yet on
    disk (this process's share), then the manifest is finalized on the main process. Returns it.
    storage: features.storage (auto: the target's dtype; cache_storage). topk_logits = k > 0: the shards also hold
    the target's top-k next-token distribution (features.topk_logits)."""
    from tqdm import tqdm

    storage = cache_storage(storage, target, Path(dest), dist)
    manifest = features_manifest(target, layer_ids, storage, max_length, prepared.info, shard_sequences,
                                 topk_logits)
    root = Path(dest)
    seqs = prepared.sequences
    num_shards = math.ceil(len(seqs) / shard_sequences)
    if dist.is_main:
        fcache.open_for_writing(root, manifest)
    dist.wait_long("extract-open")  # the processes come from completions and target loading of their own
    done = fcache.done_shards(root)
    mine = [k for k in range(num_shards) if k % dist.world == dist.rank and k not in done]
    tokens = sum(s.input_ids.numel() for k in mine for s in seqs[k * shard_sequences:(k + 1) * shard_sequences])
    if done:
        log.info("cache %s: %d of %d shards already written; resuming", root, len(done), num_shards)
    log.info("process %d of %d extracts shards %s", dist.rank, dist.world, mine)
    bar = tqdm(total=tokens, desc=f"extract[{dist.rank}]", unit="tok", unit_scale=True, disable=None)
    stamp = fcache.Stamp(root, dist.rank)  # the writer's digests: training need not hash these shards again
    for k in mine:
        part = seqs[k * shard_sequences:(k + 1) * shard_sequences]
        feats: list[torch.Tensor | None] = [None] * len(part)
        soft: list | None = [None] * len(part) if topk_logits else None
        for i, f, top in batched_features(target, [s.input_ids for s in part], layer_ids, batch_tokens,
                                          topk_logits):
            feats[i] = f.cpu()
            if soft is not None:
                soft[i] = TopK(top.logprobs.cpu(), top.ids.cpu(), top.rest.cpu())
            bar.update(part[i].input_ids.numel())
        fcache.write_shard(root, k, [s.id for s in part], [s.input_ids for s in part],
                           [s.loss_mask for s in part], feats, storage, len(layer_ids), stamp=stamp, topk=soft)
    bar.close()
    drain(target)  # a tensor-parallel group runs each of its processes' forwards together (shares may differ)
    dist.wait_long("extract")  # hours, and not the same on every process
    if dist.is_main:
        fcache.finalize(root, num_shards)
    dist.barrier()
    return fcache.read_manifest(root)


def completions_store(data: DataConfig, features: FeaturesConfig) -> Path:
    """The training completions: data.completions.path, or completions.jsonl next to the features."""
    return Path(data.completions.path) if data.completions.path else Path(features.dir).parent / "completions.jsonl"


def training_prompts(data: DataConfig) -> list[Prompt]:
    """The prompts data.* picks (data.offset, data.limit included)."""
    return load_prompts(data.prompts, data.format, data.split, data.prompt_key, data.offset, data.limit)


def prepare_training(job: JobConfig, target: Target, dist: Dist) -> Prepared:
    """The training sequences of `job`: data.prompts (or each source of data.sources) with the target's
    completions."""
    if job.features.source == "vllm" and job.train.mode == "online":  # online training computes them in-process
        raise ConfigError("features.source=vllm extracts a feature cache (extract.py, or train.mode=offline); "
                          "train.mode=online computes the features with the target in this process: set "
                          "features.source=hf or train.mode=offline")
    store, parts = completions_store(job.data, job.features), []
    for source in sources_of(job.data):  # data.* alone, or each source of a mixture (dflash.data.mixture)
        data = source.data
        parts.append((source, prepare_sequences(
            training_prompts(data), data.prompts, target, data.completions, source_store(store, source), dist,
            chat_template=data.chat_template, enable_thinking=data.enable_thinking, max_length=data.max_length,
            regenerate=data.regenerate, template_kwargs=data.chat_template_kwargs, tools=data.tools,
            skip_bad_records=data.skip_bad_records)))
    return merge(parts)


def extract_training(job: JobConfig, target: Target, dist: Dist) -> dict:
    """Training sequences and their features into job.features.dir, with an already-loaded target (for
    features.source=vllm its heads and tokenizer are enough, unless it generates the completions)."""
    prepared = prepare_training(job, target, dist)
    if job.features.source == "vllm":
        dest = Path(job.features.dir)
        # vLLM computes in target.dtype too; its extraction reads the storage from the config group it is given
        features = replace(job.features, storage=cache_storage(job.features.storage, target, dest, dist))
        return extract_features_vllm(target, job.target, resolve_layer_ids(job.layers, target.num_layers), prepared,
                                     dest, dist, features, job.data.max_length)
    return extract_features(target, resolve_layer_ids(job.layers, target.num_layers), prepared,
                            Path(job.features.dir), dist, storage=job.features.storage,
                            shard_sequences=job.features.shard_sequences, batch_tokens=job.features.batch_tokens,
                            max_length=job.data.max_length, topk_logits=job.features.topk_logits)


def extract(job: JobConfig) -> dict:
    """extract.py: completions, then features, into job.features.dir."""

    setup_logging()
    dist = dist_mod.current(job.train.collective_timeout_minutes)
    # vLLM runs the target in its own venv: here its heads and tokenizer name it, unless it generates completions
    target = load_target(job.target, heads_only=job.features.source == "vllm" and job.data.completions.source != "hf")
    t0 = time.time()
    manifest = extract_training(job, target, dist)
    if dist.is_main:
        log.info("cache %s: %d sequences, %d tokens, %s features in %d shards (%.0f s)", job.features.dir,
                 manifest["num_sequences"], manifest["num_tokens"], manifest["storage"], len(manifest["shards"]),
                 time.time() - t0)
    return manifest
