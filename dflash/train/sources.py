"""What training reads: the target (its heads alone when every feature is cached), the training
source (the feature cache, extracted first if missing; or token sequences for online mode) and
the manifest of the features it trains on."""

from __future__ import annotations

import gc
import logging

import torch

from dflash.config import JobConfig
from dflash.data import cache as fcache
from dflash.data.extraction import extract_training, prepare_training
from dflash.dist import Dist
from dflash.errors import ConfigError
from dflash.evaluate import heldout
from dflash.provenance import check_provenance, features_manifest, target_signature
from dflash.target.layer_ids import resolve_layer_ids
from dflash.target.loading import Target, load_target
from dflash.train.batches import CachedSource, SequenceSource

log = logging.getLogger(__name__)


def training_target(job: JobConfig, device: torch.device) -> tuple[Target, list[int]]:
    """The target as training needs it, and the layer ids the drafter reads. Offline training with
    a complete feature cache and held-out set needs only embed_tokens and lm_head; anything still
    to extract (or online mode) needs the whole model."""
    offline = job.train.mode == "offline"
    target = load_target(job.target, device, heads_only=offline)
    layer_ids = resolve_layer_ids(job.layers, target.num_layers)
    if target.model is None and not (fcache.is_complete(job.features.dir)
                                     and heldout.is_ready(job, target, layer_ids)):
        target = load_target(job.target, device)
    return target, layer_ids


def training_source(job: JobConfig, target: Target, layer_ids: list[int], dist: Dist):
    """(source, manifest): offline, the feature cache of job.features.dir (extracted first when
    missing, refused when made from another target, tokenizer, dtype or layers); online, the
    token sequences, whose features the loop computes with the target."""
    if job.train.mode == "online":
        prepared = prepare_training(job, target, dist)
        manifest = features_manifest(target, layer_ids, "online", job.data.max_length, prepared.info,
                                     job.features.shard_sequences)
        return SequenceSource(prepared.sequences), manifest
    if not fcache.is_complete(job.features.dir):
        log.info("no complete feature cache at %s: extracting it first", job.features.dir)
        extract_training(job, target, dist)
    cache = fcache.FeatureCache(job.features.dir, dtype=torch.float32)
    cache.verify_all()  # here, not in a DataLoader worker (which would wrap the message in its traceback)
    if cache.manifest["layer_ids"] != layer_ids:
        raise ConfigError(f"features.dir={job.features.dir} holds layers {cache.manifest['layer_ids']} but the "
                          f"drafter reads {layer_ids}; set features.dir to a new directory or change layers")
    # kernels are checked where the model runs: at evaluation, and against the checkpoint on resume
    check_provenance({**target_signature(target), "layer_ids": layer_ids}, cache.manifest,
                     job.provenance.allow_mismatch, expected_name=f"target {job.target.name}",
                     actual_name=f"the feature cache {job.features.dir}",
                     fields=("target", "tokenizer", "dtype", "layer_ids"))
    return CachedSource(cache), cache.manifest


def keep_heads_only(target: Target) -> None:
    """Free the decoder layers once nothing is left to extract (offline training)."""
    if target.model is None:
        return
    target.model = target.layers = target.final_norm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
