"""The held-out set: target completions of eval.prompts and their features, in a cache of their own, made by
the same extraction API as the training data. Greedy completions; at eval.decode.temperature > 0 completions sampled
at eval's temperature / top-p / top-k (live decoding writes sampled text there too), and the target's top-k
next-token distribution at every position (eval.topk_logits) for the expected acceptance.

Its folder is keyed by a hash of everything that changes the held-out sequences: the target's
weights, tokenizer and dtype, the prompts (their content, not only the file name), eval.max_prompts,
eval.max_new_tokens, data.chat_template, data.enable_thinking, when prompts are batched
eval.completions_batch_size (a set made one prompt at a time keeps its key), and when sampled the sampling
settings and eval.topk_logits (a greedy set keeps its key), data.completions.stop when set, and for prompts
with several user turns eval.turns. Every user turn of a conversation is an item of its own (ids <id>,
<id>:turn2, ...), after the target's own answers to the earlier ones (dflash.data.sequences, all_turns), unless
eval.turns=first; a tool conversation has an item per generation point (dflash.data.tools, data.tools.keep_results in
the key), and the manifest lists its tool turns (eval.slices' tools). A training mixture (data.sources) gets an item per prompt and rendering of its sources (thinking
on, off, template switches: dflash.data.mixture.views), ids <view>/<id>, the renderings in the key. The held-out completions are never truncated, so data.max_length plays no part. The features
folder is per layer set (drafters compared side by side may read different layers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from dflash.config import DataConfig, EvalConfig, JobConfig
from dflash.data import cache as fcache
from dflash.data.extraction import extract_features
from dflash.data.mixture import merge, rendering, source_store, views
from dflash.data.prompts import load_prompts, prompts_hash
from dflash.data.sequences import prepare_sequences
from dflash.data.tools import is_tool, turn_count
from dflash.dist import Dist
from dflash.errors import CacheError
from dflash.layout import CacheLayout
from dflash.provenance import check_kernels, differences, target_signature

log = logging.getLogger(__name__)


def _prompts(cfg: EvalConfig):
    return load_prompts(cfg.prompts, limit=cfg.max_prompts)


def heldout_key(data: DataConfig, cfg: EvalConfig, target, prompts=None) -> dict:
    """Everything the held-out sequences depend on (what keys its folder): the data group's rendering and the eval
    group's held-out set; `prompts` when already read."""
    prompts = _prompts(cfg) if prompts is None else prompts
    batch = cfg.completions_batch_size
    mixed = [[name, rendering(source)] for name, source in views(data) if name]  # as JSON reads it back
    return {**target_signature(target), "prompts": cfg.prompts, "prompts_sha256": prompts_hash(prompts),
            "max_prompts": cfg.max_prompts, "max_new_tokens": cfg.max_new_tokens,
            "chat_template": data.chat_template, "enable_thinking": data.enable_thinking,
            **({"views": mixed} if mixed else {}),
            **({"completions_batch_size": batch} if batch > 1 else {}),
            **({"stop": list(data.completions.stop)} if data.completions.stop else {}),
            **({"chat_template_kwargs": dict(data.chat_template_kwargs)} if data.chat_template_kwargs else {}),
            # conversations: which turns are items (one-turn sets keep their keys)
            **({"turns": cfg.turns} if any(turn_count(p) > 1 for p in prompts) else {}),
            # tool conversations: how the target's own calls carry them on
            **({"tool_results_kept": data.tools.keep_results} if any(map(is_tool, prompts)) else {}),
            **sampling_key(cfg)}


def sampling_key(cfg) -> dict:
    """What a sampled held-out set adds to its key (cfg: the eval group); nothing for a greedy one."""
    d = cfg.decode
    if d.temperature <= 0:
        return {}
    return {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "topk_logits": cfg.topk_logits,
            **({"seed": d.seed} if d.seed else {})}


def heldout_paths(job: JobConfig, target, layer_ids: list[int], key: dict | None = None) -> tuple[Path, Path]:
    """(features folder, completions file) of the held-out set; by default under cache/<target>/."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(job.eval.prompts.removeprefix("builtin:")).stem)
    key = heldout_key(job.data, job.eval, target) if key is None else key
    sig = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    base = CacheLayout(Path(job.features.dir)).target_root / f"eval-{name}-n{job.eval.max_new_tokens}-{sig}"
    layers = "L" + "-".join(map(str, layer_ids))
    features = Path(job.eval.features_dir) / layers if job.eval.features_dir else base / f"features-{layers}"
    completions = Path(job.eval.completions_path) if job.eval.completions_path else base / "completions.jsonl"
    return features, completions


def is_ready(job: JobConfig, target, layer_ids: list[int]) -> bool:
    return fcache.is_complete(heldout_paths(job, target, layer_ids)[0])


def prepare(job: JobConfig, target, layer_ids: list[int], dist: Dist) -> None:
    """Make the held-out set if it is not complete: eval.prompts (at most eval.max_prompts), completions of
    eval.max_new_tokens (greedy, or sampled at eval.decode.temperature > 0 with the target's top-k distributions
    stored; eval.completions_batch_size prompts a batch, left-padded), untruncated, features of `layer_ids` stored in
    the target's dtype (storage auto: exact, as the target computes them, and as live decoding and training's cache
    see them; a bfloat16 target's set is half the bytes of float32). Needs the full target."""
    prompts = _prompts(job.eval)
    key = heldout_key(job.data, job.eval, target, prompts)
    features_dir, store = heldout_paths(job, target, layer_ids, key)
    if fcache.is_complete(features_dir):
        return
    log.info("extracting the held-out set %s into %s", job.eval.prompts, features_dir)
    source = "cached" if job.eval.completions_path else (
        "server" if job.data.completions.source == "server" else "hf")
    decode = job.eval.decode
    sampled = decode.temperature > 0
    # truncated="keep": live decoding stops at the same budget, so a cut answer is what it decodes too
    completions = replace(job.data.completions, source=source, path=str(store), truncated="keep",
                          max_new_tokens=job.eval.max_new_tokens, batch_size=job.eval.completions_batch_size,
                          temperature=decode.temperature, top_p=decode.top_p, top_k=decode.top_k,
                          seed=decode.seed)
    parts = []
    for name, source in views(job.data):  # a mixture: each rendering of its sources (thinking on, off, ...)
        view = replace(source, name=name)
        parts.append((view, prepare_sequences(
            prompts, job.eval.prompts, target, completions, source_store(store, view), dist,
            chat_template=job.data.chat_template, enable_thinking=source.data.enable_thinking, max_length=None,
            regenerate="all_turns" if job.eval.turns == "all" else "first_turn",
            template_kwargs=source.data.chat_template_kwargs, tools=job.data.tools,
            skip_bad_records=job.data.skip_bad_records)))
    prepared = merge(parts)
    prepared.info["heldout_key"] = key  # checked again by load(), wherever the set lives
    extract_features(target, layer_ids, prepared, features_dir, dist, storage="auto",
                     shard_sequences=job.features.shard_sequences, batch_tokens=job.features.batch_tokens,
                     max_length=None, topk_logits=job.eval.topk_logits if sampled else 0)


def load(job: JobConfig, target, layer_ids: list[int]) -> fcache.FeatureCache:
    """The held-out features; refused if they were made for other settings (an explicit
    eval.features_dir is not keyed by them) or the target now runs other kernels than made them."""
    now = heldout_key(job.data, job.eval, target)
    cache = fcache.FeatureCache(heldout_paths(job, target, layer_ids, now)[0], dtype=torch.float32)
    made_for = cache.manifest.get("data", {}).get("heldout_key")
    if made_for is not None and made_for != now:
        diff = differences(made_for, now)
        raise CacheError(f"the held-out set in {cache.root} was made for other settings ({diff[:600]}); delete it "
                         f"or point eval.features_dir elsewhere to make it anew")
    check_kernels(cache.manifest, target, cache.root)
    return cache
