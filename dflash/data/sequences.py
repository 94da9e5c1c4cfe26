"""Training and evaluation sequences: prompt, then the target's own completion, with a loss mask
on the response. Everything downstream (features, blocks, labels) is made from these."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.config import CompletionsConfig, ToolsConfig
from dflash.data.completions import completion_ids, end_of_turn_id, obtain, text_sha
from dflash.data.prompts import (Prompt, check_chat_template, conversation_id, encode, prompt_text, prompts_hash,
                                 source_record, turn_id, turn_messages)
from dflash.data.tools import ToolConversations
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
                      dist: Dist, *, chat_template: bool, enable_thinking: bool | None,
                      max_length: int | None, regenerate: str = "all_turns",
                      template_kwargs: dict | None = None, tools: ToolsConfig | None = None,
                      skip_bad_records: bool = False) -> Prepared:
    """Prompts -> chat text -> target completions -> token sequences with a response loss mask.

    `source` names the prompt set (for messages and the manifest); completions are read from or
    generated into the JSONL store `store` as `completions` says. Prompts that leave no room for a
    response within `max_length` (None: no limit, nothing truncated) are skipped and counted, as
    are prompts without a completion (source=cached).

    A conversation with later user turns (Prompt.conversation) gives, by `regenerate` (data.regenerate):
    all_turns, a sequence per user turn, generated turn by turn: the messages up to that turn with every earlier
    assistant turn the target's own answer (its completion's text, as a server gets it back in the next
    request), rendered by the chat template as serving renders them, then the target's answer, loss on that
    answer (ids <id>, <id>:turn2, ...: dflash.data.prompts.turn_id); last_turn, one sequence, the answer to the
    last user turn after the conversation's own earlier turns; first_turn, the first user turn alone.
    template_kwargs: the chat template's other switches (data.chat_template_kwargs), recorded with the rest.
    Tool conversations (records with tools, tool calls, tool results) are answered at every generation point, as
    dflash.data.tools says (data.tools; data.skip_bad_records: skip bad records, counted, instead of stopping).
    """
    template_kwargs = dict(template_kwargs or {})
    tok = target.tokenizer
    check_chat_template(tok, chat_template)  # a base model asked for chat prompts: refused before anything is generated
    talks = ToolConversations(
        prompts, source, lambda messages, tools: prompt_text(tok, messages, chat_template, enable_thinking,
                                                              template_kwargs, tools),
        regenerate, (tools or ToolsConfig()).keep_results, skip_bad_records)
    multi = any(talks.turns(p) > 1 for p in prompts)
    # a cached file is read as it is; the settings guard only stores that hf/server extend (and
    # fingerprinting a 250k-token tokenizer such as Qwen3.5's takes seconds)
    settings = ({} if completions.source == "cached"
                else generation_settings(target, completions, chat_template, enable_thinking, template_kwargs))
    eos_id = end_of_turn_id(tok) if tok else None
    skipped = {"prompt_too_long": 0, "no_completion": 0, "completion_too_short": 0}
    truncated = 0  # completions that reached max_new_tokens before the end of their turn
    answers: dict[str, list[str]] = {p.id: [] for p in prompts}  # the target's answers so far (all_turns)
    sequences, retokenized = [], 0
    for turn, todo in _rounds(prompts, regenerate, talks.turns):
        # all_turns: a turn needs the target's answers to every earlier one (one missing: the rest is skipped)
        todo = [p for p in todo if regenerate != "all_turns" or len(answers[p.id]) == turn]
        items = []
        for p in todo:
            if p.id in talks.steps:  # a tool conversation: None where it ended (counted)
                messages = talks.messages(p, turn)
                if messages is None:
                    continue
            else:
                messages = turn_messages(p, turn, answers[p.id] if regenerate == "all_turns" else None)
            iid = turn_id(p.id, turn)
            text = prompt_text(tok, messages, chat_template, enable_thinking, template_kwargs, p.tools,
                               where=f"{source} prompt {iid}")
            items.append((p, iid, text, encode(tok, text)))
        fits = [it for it in items if max_length is None or len(it[3]) + 2 <= max_length]
        skipped["prompt_too_long"] += len(items) - len(fits)
        records = obtain(completions, store, [(iid, text) for _, iid, text, _ in fits], settings, dist,
                         target=target, model=completions.model or str(target.path), eos_id=eos_id)
        for p, iid, text, ids in fits:
            rec = records.get(iid)
            if rec is None or rec.get("prompt_sha") not in (None, text_sha(text)):
                skipped["no_completion"] += 1
                continue
            cut = rec.get("finish_reason") == "length"
            if p.id in talks.steps and not talks.answered(p, turn, iid, rec.get("completion", ""), cut):
                continue  # a call of the target's that is not valid JSON: the record is skipped (counted)
            answers[p.id].append(rec.get("completion", ""))  # a later turn follows the answer as it was
            if cut:
                truncated += 1
                if completions.truncated == "drop":
                    skipped["truncated"] = skipped.get("truncated", 0) + 1
                    continue
            retokenized += rec.get("completion_ids") is None
            seq = build_sequence(iid, ids, completion_ids(rec, tok, eos_id), max_length)
            if seq is None:
                skipped["completion_too_short"] += 1
                continue
            sequences.append(seq)
    if skip_bad_records:  # a bad record's sequences go, the ones made before it was found bad too
        sequences = [s for s in sequences if conversation_id(s.id) not in talks.bad]
        skipped["bad_records"] = len(talks.bad)
    if skipped["prompt_too_long"]:
        log.warning("skipped %d prompts longer than data.max_length=%d tokens", skipped["prompt_too_long"],
                    max_length)
    if skipped["no_completion"]:
        log.warning("%d prompts have no completion in %s and are skipped", skipped["no_completion"], store)
    if truncated:
        log.info("%d completions reached %d tokens before the end of their turn: %s (data.completions.truncated)",
                 truncated, completions.max_new_tokens, "dropped" if completions.truncated == "drop" else "kept")
    if not sequences:
        raise DataError(f"no training sequences from {source} (skipped: {skipped}); check data.prompts, "
                        f"data.max_length and the completions in {store}")
    comp_hash = hashlib.sha256(
        "".join(f"{s.id}:{s.input_ids.tolist()}" for s in sequences).encode()).hexdigest()[:16]
    if retokenized:
        log.warning("%d completions came as text only and were re-tokenized (the ids may differ from what the target "
                    "generated); recorded in the manifest as completions_retokenized", retokenized)
    settings = made_with(chat_template=chat_template, enable_thinking=enable_thinking, template_kwargs=template_kwargs,
                         regenerate=regenerate, truncated=completions.truncated,
                         keep_results=(tools or ToolsConfig()).keep_results)
    tool_info = talks.info()  # its tool_results_kept is the one `recorded` writes: the same keep_results
    info = {"prompts": source, "prompts_sha256": prompts_hash(prompts), "completions": str(store),
            "sequences_sha256": comp_hash, "num_prompts": len(prompts), "num_sequences": len(sequences),
            "skipped": skipped, "completions_retokenized": retokenized, "truncated": truncated,
            **recorded(settings, multi_turn=multi, tools=bool(tool_info)), **tool_info,
            **source_record(source)}  # a sharegpt: source's file and counts (whole records, the cut, skips)
    return Prepared(sequences, info)


def made_with(*, chat_template: bool, enable_thinking: bool | None, template_kwargs: dict | None, regenerate: str,
              truncated: str, keep_results: bool) -> dict:
    """Every setting of how a set's sequences are made from its prompts, keyed as its manifest records them. The one
    list of them: prepare_sequences writes them (`recorded`) and the data check (dflash.train.sources) builds what
    data.* gives now from them, so a setting added here is written and compared both, never one alone."""
    return {"truncated_kept": truncated == "keep", "chat_template": chat_template, "enable_thinking": enable_thinking,
            "chat_template_kwargs": dict(template_kwargs or {}), "regenerate": regenerate,
            "tool_results_kept": keep_results}


def recorded(settings: dict, *, multi_turn: bool, tools: bool) -> dict:
    """made_with's `settings` as a set's info writes them, the manifest unchanged since each was added: truncated_kept
    only when False (caches from before it counted truncated answers and kept them), regenerate only for a set with
    multi-turn conversations and tool_results_kept only for one with tool conversations (elsewhere they change
    nothing, and leaving them out keeps such caches matching whatever they are set to)."""
    left_out = {"truncated_kept": settings["truncated_kept"], "regenerate": not multi_turn,
                "tool_results_kept": not tools}
    return {k: v for k, v in settings.items() if not left_out.get(k, False)}


def read_record(info: dict) -> dict:
    """A set's info (or a mixture source's entry) with the setting `recorded` leaves implicit written out:
    truncated_kept True where truncated answers are counted (`truncated`) without it. A made_with setting still
    absent was not recorded (a cache older than it, or one it changes nothing in): it cannot be compared."""
    return {"truncated_kept": True, **info} if "truncated" in info else info


def _rounds(prompts: list[Prompt], regenerate: str, turns) -> list[tuple[int, list[Prompt]]]:
    """(turn, the prompts answered at it) in the order they are generated: all_turns turn by turn (each needs
    the answers before it), last_turn each conversation's last turn, first_turn the first. turns(prompt): its user
    turns, a tool conversation's generation points (0: a bad record, skipped)."""
    prompts = [p for p in prompts if turns(p) > 0]
    if regenerate == "first_turn":
        return [(0, prompts)]
    if regenerate == "last_turn":
        by_turn: dict[int, list[Prompt]] = {}
        for p in prompts:
            by_turn.setdefault(turns(p) - 1, []).append(p)
        return sorted(by_turn.items())
    return [(t, [p for p in prompts if turns(p) > t]) for t in range(max(map(turns, prompts), default=0))]
