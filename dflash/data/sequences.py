"""Training and evaluation sequences: prompt, then the target's own completion, with a loss mask
on the response. Everything downstream (features, blocks, labels) is made from these."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.config import CompletionsConfig
from dflash.data.completions import completion_ids, end_of_turn_id, obtain, text_sha
from dflash.data.prompts import Prompt, encode, prompt_text, prompts_hash
from dflash.dist import Dist
from dflash.errors import DataError
from dflash.provenance import generation_settings

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One training/evaluation sequence: prompt then response; loss_mask marks the response."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def build_sequence(pid: str, prompt_ids: list[int], completion_ids: list[int],
                   max_length: int | None) -> Sequence | None:
    """prompt + completion, truncated to max_length (None: not truncated); None when the prompt
    alone does not fit with at least two response tokens (one anchor needs p and p+1 in the response)."""
    if len(completion_ids) < 2 or (max_length is not None and len(prompt_ids) + 2 > max_length):
        return None
    if max_length is not None:
        completion_ids = completion_ids[: max_length - len(prompt_ids)]
    ids = torch.tensor(prompt_ids + completion_ids, dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt_ids):] = True
    return Sequence(pid, ids, mask)


@dataclass
class Prepared:
    sequences: list[Sequence]
    info: dict
    """What the sequences were made from: sources, hashes, counts of what was skipped."""


def prepare_sequences(prompts: list[Prompt], source: str, target, completions: CompletionsConfig, store: Path,
                      dist: Dist, *, chat_template: bool, enable_thinking: bool,
                      max_length: int | None) -> Prepared:
    """Prompts -> chat text -> target completions -> token sequences with a response loss mask.

    `source` names the prompt set (for messages and the manifest); completions are read from or
    generated into the JSONL store `store` as `completions` says. Prompts that leave no room for a
    response within `max_length` (None: no limit, nothing truncated) are skipped and counted, as
    are prompts without a completion (source=cached).
    """
    texts = [prompt_text(target.tokenizer, p, chat_template, enable_thinking) for p in prompts]
    ids = [encode(target.tokenizer, t) for t in texts]
    fits = [i for i in range(len(prompts)) if max_length is None or len(ids[i]) + 2 <= max_length]
    skipped = {"prompt_too_long": len(prompts) - len(fits), "no_completion": 0, "completion_too_short": 0}
    if skipped["prompt_too_long"]:
        log.warning("skipping %d of %d prompts longer than data.max_length=%d tokens",
                    skipped["prompt_too_long"], len(prompts), max_length)
    # a cached file is read as it is; the settings guard only stores that hf/server extend (and
    # fingerprinting a 250k-token tokenizer such as Qwen3.5's takes seconds)
    settings = ({} if completions.source == "cached"
                else generation_settings(target, completions, chat_template, enable_thinking))
    eos_id = end_of_turn_id(target.tokenizer) if target.tokenizer else None
    records = obtain(completions, store, [(prompts[i].id, texts[i]) for i in fits], settings, dist,
                     target=target, model=completions.model or str(target.path), eos_id=eos_id)
    sequences = []
    for i in fits:
        rec = records.get(prompts[i].id)
        if rec is None or rec.get("prompt_sha") not in (None, text_sha(texts[i])):
            skipped["no_completion"] += 1
            continue
        seq = build_sequence(prompts[i].id, ids[i], completion_ids(rec, target.tokenizer, eos_id), max_length)
        if seq is None:
            skipped["completion_too_short"] += 1
            continue
        sequences.append(seq)
    if skipped["no_completion"]:
        log.warning("%d prompts have no completion in %s and are skipped", skipped["no_completion"], store)
    if not sequences:
        raise DataError(f"no training sequences from {source} (skipped: {skipped}); check data.prompts, "
                        f"data.max_length and the completions in {store}")
    comp_hash = hashlib.sha256(
        "".join(f"{s.id}:{s.input_ids.tolist()}" for s in sequences).encode()).hexdigest()[:16]
    retokenized = sum(1 for i in fits if prompts[i].id in records
                      and records[prompts[i].id].get("completion_ids") is None)
    if retokenized:
        log.warning("%d completions came as text only and were re-tokenized (the ids may differ from what the target "
                    "generated); recorded in the manifest as completions_retokenized", retokenized)
    info = {"prompts": source, "prompts_sha256": prompts_hash(prompts), "completions": str(store),
            "sequences_sha256": comp_hash, "num_prompts": len(prompts), "num_sequences": len(sequences),
            "skipped": skipped, "completions_retokenized": retokenized, "chat_template": chat_template,
            "enable_thinking": enable_thinking}
    return Prepared(sequences, info)
