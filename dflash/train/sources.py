"""What training reads: the target (its heads alone when every feature is cached), the training
source (the feature cache, extracted first if missing; or token sequences for online mode) and
the manifest of the features it trains on."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from dflash.config import DataConfig, FeaturesConfig, JobConfig, LossConfig
from dflash.config.data import rounds
from dflash.data import cache as fcache
from dflash.data.extraction import extract_training, prepare_training, rounding_warning, training_prompts
from dflash.data.mixture import sampling, sources_of
from dflash.data.prompts import BUILTIN, prompts_hash
from dflash.data.sequences import made_with, read_record
from dflash.data.stamp import Stamp, file_state
from dflash.dist import Dist
from dflash.errors import CacheError, ConfigError, DFlashError
from dflash.evaluate import heldout
from dflash.provenance import check_provenance, differences, features_manifest, target_signature
from dflash.target.layer_ids import resolve_layer_ids
from dflash.target.loading import Target, load_target
from dflash.train.batches import CachedSource, SequenceSource
from dflash.train.fit import check_length_fit, check_online_fit

log = logging.getLogger(__name__)


def training_target(job: JobConfig, device: torch.device, checkpointing: str,
                    plan: tuple | None = None) -> tuple[Target, list[int]]:
    """The target as training needs it, and the layer ids the drafter reads. Offline training with
    a complete feature cache and held-out set needs only embed_tokens and lm_head; anything still
    to extract (or online mode) needs the whole model: online, on every process's device beside the
    drafter, refused before loading when it cannot fit there, as is a data.max_length whose step cannot with
    `checkpointing` (the resolved mode, dflash.train.fit.resolve_checkpointing; plan: its step_plan)."""
    offline = job.train.mode == "offline"
    if not offline:
        check_online_fit(job, device)
    check_length_fit(job, device, checkpointing, plan)
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
    extracted_now = not fcache.is_complete(job.features.dir)
    check_soft_labels(job.loss, job.features, None if extracted_now else fcache.read_manifest(Path(job.features.dir)))
    if extracted_now:
        log.info("no complete feature cache at %s: extracting it first", job.features.dir)
        extract_training(job, target, dist)
    cache = fcache.FeatureCache(job.features.dir, dtype=torch.float32)
    made = cache.manifest  # a cache extracted just now: its extraction has said so already
    if not extracted_now and dist.is_main and rounds(made["storage"], made.get("dtype", made["storage"])):
        log.warning(rounding_warning(job.features.dir, made["storage"], made["dtype"]))
    cache.verify_all(dist)  # each shard hashed once, by one process; nothing at a second start
    if not extracted_now:  # a cache just extracted is of data.* by construction
        check_data(job.data, job.features, cache.manifest, cache.stamp)
    if cache.manifest["layer_ids"] != layer_ids:
        raise ConfigError(f"features.dir={job.features.dir} holds layers {cache.manifest['layer_ids']} but the "
                          f"drafter reads {layer_ids}; set features.dir to a new directory or change layers")
    # kernels are checked where the model runs: at evaluation, and against the checkpoint on resume
    check_provenance({**target_signature(target), "layer_ids": layer_ids}, cache.manifest,
                     job.provenance.allow_mismatch, expected_name=f"target {job.target.name}",
                     actual_name=f"the feature cache {job.features.dir}",
                     fields=("target", "tokenizer", "dtype", "layer_ids"))
    return CachedSource(cache), cache.manifest


def check_soft_labels(loss_cfg: LossConfig, features: FeaturesConfig, manifest: dict | None) -> None:
    """A soft-label loss (loss=kl, tv, nla, expected_tau) offline needs the target's top-k distributions in
    the cache (features.topk_logits): refuse, before any extraction or training, a cache without them
    (`manifest`) or an extraction that would not store them (manifest None)."""
    if not loss_cfg.soft_labels:
        return
    loss = f"loss={loss_cfg.objective}"
    if manifest is None and not features.topk_logits:
        raise ConfigError(f"{loss} trains on the target's next-token distributions, and features.topk_logits=0 "
                          f"extracts none into the cache: set features.topk_logits (e.g. 64), or train with "
                          f"train.mode=online")
    if manifest is not None and not manifest.get("topk_logits"):
        raise ConfigError(f"{loss} trains on the target's next-token distributions, and the feature cache "
                          f"{features.dir} stores none (extracted without features.topk_logits): extract "
                          f"into a new features.dir with features.topk_logits=64 (say), or train with "
                          f"train.mode=online")
    if manifest is not None and features.topk_logits and manifest["topk_logits"] != features.topk_logits:
        raise ConfigError(f"features.topk_logits={features.topk_logits}, but the feature cache "
                          f"{features.dir} stores the top {manifest['topk_logits']}: set "
                          f"features.topk_logits={manifest['topk_logits']} (or 0: what the cache holds), or "
                          f"extract into a new features.dir")


def prompts_key(data: DataConfig) -> dict | None:
    """What the prompts data.* picks are a function of, found without reading them: the data.* settings
    that pick prompts and the state (size, mtime, ctime, inode) of every file under data.prompts (more
    files than are read, so that a changed, added or removed prompts file changes the key). None where
    the prompts are not local files (toy:, a Hub dataset): those are read at every check."""
    if data.prompts.startswith("toy:"):
        return None
    where = BUILTIN if data.prompts.startswith("builtin:") else Path(data.prompts).expanduser()
    if not where.exists():
        return None
    files = sorted(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else [where]
    return {"prompts": data.prompts, "format": data.format, "split": data.split, "prompt_key": data.prompt_key,
            "offset": data.offset, "limit": data.limit,
            "files": [{"path": str(p.resolve()), **file_state(p)} for p in files]}


def check_data(data: DataConfig, features: FeaturesConfig, manifest: dict, stamp: Stamp | None = None) -> None:
    """Refuse a feature cache extracted from other data than data.* now asks for (other prompts, another
    data.limit or data.offset, max length, or any setting its sequences were made with: chat template, thinking,
    regeneration, ...: data_now): the run would train on it silently. The prompts are read again to compare
    them, once: `stamp` (the cache's) keeps their count and hash with `prompts_key`, so a later start reads them
    only if a prompts file or a setting that picks prompts has changed. Where they cannot be read here (a cache
    made elsewhere), the cache is taken as it is, with a warning."""
    made = manifest.get("data", {})
    if data.sources or "sources" in made:
        return check_mixture(data, features, manifest)
    key = prompts_key(data) if stamp is not None else None
    read = stamp.data_result(key) if key is not None else None
    if read is None:
        try:
            prompts = training_prompts(data)
        except (OSError, DFlashError) as e:
            log.warning("could not read data.prompts=%s to check that %s was extracted from them (%s); training "
                        "on the cache as it is", data.prompts, features.dir, e)
            return
        read = {"num_prompts": len(prompts), "prompts_sha256": prompts_hash(prompts)}
        if key is not None:
            stamp.data = {"key": key, "result": read}
            stamp.save()
    now = {**data_now(data, read), "max_length": data.max_length}
    diff = data_differences({**made, "max_length": manifest.get("max_length")}, now)
    if diff:
        raise CacheError(f"the feature cache {features.dir} was extracted from other data than data.* gives "
                         f"({diff}). Delete that folder to extract it anew (the completions stored "
                         f"next to it are kept and reused), or set features.dir to another folder")


def check_mixture(data: DataConfig, features: FeaturesConfig, manifest: dict) -> None:
    """check_data for a mixture (data.sources): every source's name, prompts (read again: their count and hash),
    completions sampling and every setting its sequences were made with (dflash.data.sequences.made_with) must be the
    cache's, in order, and so must data.max_length. The weights are not: they choose among the cached sequences, the
    features are the same."""
    now = []
    for source in sources_of(data):
        prompts = training_prompts(source.data)
        read = {"num_prompts": len(prompts), "prompts_sha256": prompts_hash(prompts)}
        now.append({"name": source.name, **data_now(source.data, read), "completions_sampling": sampling(source)})
    made = manifest.get("data", {}).get("sources", [])
    diffs = [f"source {n['name']}: {diff}" for m, n in zip(made, now) if (diff := data_differences(m, n))]
    if len(made) != len(now):
        diffs.insert(0, f"{len(made)} sources there, {len(now)} now ({[m.get('name') for m in made]} there)")
    if manifest.get("max_length") != data.max_length:
        diffs.append(f"max_length: {manifest.get('max_length')} there, {data.max_length} now")
    if diffs:
        raise CacheError(f"the feature cache {features.dir} was extracted from another mixture than data.sources "
                         f"gives ({'; '.join(diffs)[:800]}). Delete that folder to extract it anew (each source's "
                         f"completions are kept and reused), or set features.dir to another folder")


def data_now(data: DataConfig, read: dict) -> dict:
    """What data.* (the plain data, or one source's) gives now, keyed as a set's manifest records it: its prompts
    (`read`: their count and hash) and every setting its sequences are made with, from the one list of them
    (made_with), so that no recorded setting goes uncompared."""
    return {"prompts": data.prompts, **read,
            **made_with(chat_template=data.chat_template, enable_thinking=data.enable_thinking,
                        template_kwargs=data.chat_template_kwargs, regenerate=data.regenerate,
                        truncated=data.completions.truncated, keep_results=data.tools.keep_results)}


def data_differences(made: dict, now: dict) -> str:
    """differences() between a cache's record of its data (`made`: its info, or a mixture source's entry) and
    data_now, over every key of `now` the record holds: one made before a setting was recorded, or without what the
    setting applies to (regenerate without multi-turn conversations), is not refused for it."""
    there = read_record(made)
    recorded = [k for k in now if k in there]
    return differences({k: there[k] for k in recorded}, {k: now[k] for k in recorded})


def keep_heads_only(target: Target) -> None:
    """Free the decoder layers once nothing is left to extract (offline training)."""
    if target.model is None:
        return
    target.model = target.layers = target.final_norm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
