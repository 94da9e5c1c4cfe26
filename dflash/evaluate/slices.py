"""Evaluation by slice (eval.slices): tau per part of the held-out set, so that a drafter trained on one kind of
traffic shows where another kind loses (thinking off after training with thinking on, tool-call turns, long
contexts).

A slicer maps a block's record (teacher-forced: dflash.evaluate.teacher_forced's; live: a step of live decoding)
to its slice's name:
- source: the mixture view the item belongs to (dflash.data.mixture.views: its <view>/ id prefix), "all" without
  data.sources (where a prompt's own id may hold a "/", gsm8k/12, and names no view);
- thinking: that view's thinking switch, on, off or default (the chat template's own);
- tools: "tools" for an item whose conversation holds tool calls or tool results (its record's `tools`), else
  "text";
- length: the block's context length, the anchor's position, in buckets 0-2k, 2-8k, 8-32k, 32k+ tokens.
Per slice: the decoding walk's tau (tokens committed over blocks, as eval/tau), its mean over prompts, the blocks
and prompts it has (`slice_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

from dflash.config import DataConfig, EvalConfig
from dflash.data.mixture import source_of, views

KINDS = ("source", "thinking", "tools", "length")
BUCKETS = ((2048, "0-2k"), (8192, "2-8k"), (32768, "8-32k"), (float("inf"), "32k+"))


def length_bucket(position: int) -> str:
    return next(name for end, name in BUCKETS if position < end)


def slicers(data: DataConfig, cfg: EvalConfig) -> dict[str, Callable[[dict], str]]:
    """{kind: record -> slice name} for each kind of eval.slices (`cfg`), over the views of `data`."""
    switch = {name: source.data.enable_thinking for name, source in views(data)}
    names = {True: "on", False: "off", None: "default"}
    mixed = "" not in switch  # ids carry a <view>/ prefix only in a mixture: "gsm8k/12" alone is one prompt's own id

    def view(record: dict) -> str:
        return source_of(record["prompt_id"]) if mixed else ""

    every = {
        "source": lambda r: view(r) or "all",
        "thinking": lambda r: names[switch.get(view(r), data.enable_thinking)],
        "tools": lambda r: "tools" if r.get("tools") else "text",
        "length": lambda r: length_bucket(r["anchor"]),
    }
    return {kind: every[kind] for kind in cfg.slices}


def slice_metrics(steps: list[tuple[dict, int]], slicers_: dict[str, Callable[[dict], str]], prefix: str) -> dict:
    """Per slice of each kind: {prefix}/slice/<kind>/<name>/tau (tokens over blocks of the walk steps in it),
    .../tau_macro (its mean over prompts), .../blocks, .../prompts. steps: (record, tau) of the decoding walk (the
    chain's), each record with `prompt_id` and `anchor`."""
    out = {}
    for kind, of in slicers_.items():
        groups: dict[str, dict[str, list[int]]] = {}
        for record, tau in steps:
            groups.setdefault(of(record), {}).setdefault(record["prompt_id"], []).append(tau)
        for name, prompts in sorted(groups.items()):
            taus = [t for ts in prompts.values() for t in ts]
            key = f"{prefix}/slice/{kind}/{name}"
            out.update({f"{key}/tau": sum(taus) / len(taus),
                        f"{key}/tau_macro": sum(sum(ts) / len(ts) for ts in prompts.values()) / len(prompts),
                        f"{key}/blocks": len(taus), f"{key}/prompts": len(prompts)})
    return out
