"""Training mixtures (data.sources): several prompt sources, each rendered, answered and weighted its own way.

Traffic is rarely one kind: thinking on and off, several reasoning efforts, greedy code and sampled chat. A source is
data.* with its own keys applied (`Source.data`): its prompts, limit, thinking switch, template switches, the
sampling of its completions and what it regenerates. Each source's sequences are made as a one-source set's are
(dflash.data.sequences), from a completions store of its own, their ids prefixed with the source's name
(<name>/<prompt id>, so one prompt set can appear in two sources), and the manifest lists every source with its
settings, so a changed mixture is another cache. Its weight sets its share of every epoch (`shares`,
dflash.train.batches.Schedule). Without data.sources, data.* is the one source, unnamed: ids, stores and hashes
are what they were before mixtures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dflash.config import DataConfig
from dflash.data.sequences import Prepared


@dataclass(frozen=True)
class Source:
    name: str
    """"" for the one source of a plain data.prompts (ids unprefixed), else the source's name."""
    data: DataConfig
    """data.* with this source's keys applied (its own `sources` empty)."""
    weight: float = 1.0


SETTINGS = ("format", "split", "prompt_key", "limit", "offset", "enable_thinking", "chat_template_kwargs", "regenerate")
"""The source keys that replace data.*'s of the same name where they are set."""


def sources_of(data: DataConfig) -> list[Source]:
    """The sources data.* trains from: data.sources, or data.* alone."""
    if not data.sources:
        return [Source("", data)]
    out = []
    for i, src in enumerate(data.sources):
        own = {k: getattr(src, k) for k in SETTINGS if getattr(src, k) is not None}
        sampling = {k: v for k, v in vars(src.completions).items() if v is not None}
        out.append(Source(src.name or f"source{i}", replace(data, prompts=src.prompts, sources=[], **own,
                                                            completions=replace(data.completions, **sampling)),
                          src.weight))
    return out


def item_id(source: Source, pid: str) -> str:
    """A sequence's id: <source name>/<prompt id>, or the prompt id for the unnamed one source."""
    return f"{source.name}/{pid}" if source.name else pid


def source_of(item: str) -> str:
    """The name of the source an item id belongs to ("" for an unprefixed id)."""
    name, sep, _ = item.partition("/")
    return name if sep else ""


def source_store(store: Path, source: Source) -> Path:
    """A source's completions store: the data's, or beside it <stem>.<name>.jsonl for a named source (each source's
    completions are generated with its own settings, which a store checks)."""
    return store if not source.name else store.with_name(f"{store.stem}.{source.name}{store.suffix}")


def shares(data: DataConfig, ids: list[str]) -> list[tuple[list[int], float]] | None:
    """(the indices of a source's sequences among `ids`, its share of an epoch) per source of data.sources; None
    for one source (every sequence once an epoch)."""
    sources = sources_of(data)
    if len(sources) == 1 and not sources[0].name:
        return None
    total = sum(s.weight for s in sources)
    groups: dict[str, list[int]] = {s.name: [] for s in sources}
    for i, item in enumerate(ids):
        groups.setdefault(source_of(item), []).append(i)
    return [(groups[s.name], s.weight / total) for s in sources if groups[s.name]]


def rendering(source: Source) -> dict:
    """What a held-out item depends on from its source: how the chat template renders it."""
    return {"enable_thinking": source.data.enable_thinking,
            "chat_template_kwargs": dict(source.data.chat_template_kwargs)}


def views(data: DataConfig) -> list[tuple[str, Source]]:
    """The held-out set's views of a mixture: (name, source) per distinct rendering of its sources (thinking,
    template switches), named by the sources that share it (a+b); [("", the one source)] without data.sources."""
    sources = sources_of(data)
    if len(sources) == 1 and not sources[0].name:
        return [("", sources[0])]
    grouped: dict[str, list[Source]] = {}
    for s in sources:
        grouped.setdefault(repr(sorted(rendering(s).items())), []).append(s)
    return [("+".join(s.name for s in group), group[0]) for group in grouped.values()]


def sampling(source: Source) -> dict:
    """How a source's completions are made (recorded per source in a mixture's manifest)."""
    c = source.data.completions
    return {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature,
            **({"top_p": c.top_p, "top_k": c.top_k, "seed": c.seed} if c.temperature > 0 else {})}


def merge(parts: list[tuple[Source, "Prepared"]]) -> "Prepared":
    """One set of sequences from each source's (dflash.data.sequences.Prepared): the one unnamed source's as it is;
    a mixture's ids prefixed with their source's name, and its info listing every source (name, weight, what its
    sequences were made from and how, what was skipped) with the totals."""
    import hashlib

    if len(parts) == 1 and not parts[0][0].name:
        return parts[0][1]
    sequences, listed = [], []
    for source, prepared in parts:
        for seq in prepared.sequences:
            seq.id = item_id(source, seq.id)
        if "tools" in prepared.info:  # the ids of its tool turns (dflash.data.tools), as its sequences' are
            prepared.info["tools"]["items"] = [item_id(source, i) for i in prepared.info["tools"]["items"]]
        sequences += prepared.sequences
        listed.append({"name": source.name, "weight": source.weight, **prepared.info,
                       "completions_sampling": sampling(source)})
    digest = hashlib.sha256("".join(f"{s.id}:{s.input_ids.tolist()}" for s in sequences).encode()).hexdigest()[:16]
    return Prepared(sequences, {"sources": listed, "num_sequences": len(sequences), "sequences_sha256": digest,
                                "num_prompts": sum(p.info["num_prompts"] for _, p in parts)})
