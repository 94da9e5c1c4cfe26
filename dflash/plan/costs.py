"""What a run needs besides GPU memory, for the plan (report.py): the feature cache on disk, host memory for loading
the target, GPU-hours, offline and online side by side, and which set-up each GPU size should train with.

- Cache: dflash/data/cache.py stores per token the features (target_layers x hidden values in
  features.storage; float8 adds one float32 scale per token and layer), an int32 token id and a uint8
  loss-mask byte.
- Loading (dflash/target/loading.py): the target goes from its memory-mapped safetensors straight to the
  device (device_map), tensor by tensor on transformers' loader threads, so a process holds at most
  LOADER_THREADS tensors in flight (the largest ones bound it); the files' pages sit in the page cache,
  shared by every process of the node reading them and reclaimable, up to the checkpoint's size. Offline
  training reads only embed_tokens and lm_head; extraction loads the target as online training does.
- GPU-hours: the drafter's model FLOPs of a sequence as flops.py's `train_flops` counts them (what its
  MFU is measured against: model FLOPs over the step's time, a recompute not counted); the target's
  forward is 2 FLOPs per non-embedding parameter per token (of a MoE target, the parameters a token runs through:
  all but the experts it is not routed to; attention's share is ignored: ~1%), once per
  sequence offline (extraction), every epoch online. Divided by the GPU's bf16 peak x an MFU: from the newest
  GPU result with an MFU in the plan's mfu_results folder (bench/results/ by default), the experiment's own step
  where it was measured, else the median of the steps measured without gradient checkpointing (`measured_mfu`);
  with none, ASSUMED_MFU. Gradient checkpointing runs the layers' forward again (`recompute_scale`): a step
  measured with it already spent that time in its MFU, so the recompute is counted only where the plan checkpoints
  and the measured step did not (and taken out where it is the other way round). Selective checkpointing replays no
  matmul, so it counts no recompute: its replayed norms, rotary and activations are memory-bound work the FLOP count
  leaves out, as it leaves out the forward's own (the GPU check measures its time). Generating the completions (the
  same in both modes) is not counted.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dflash.plan.memory import GiB, Setup, Shape, max_anchors, peak

PAPER_SEQUENCES, PAPER_TOKENS = 800_000, 1.2e9  # the DFlash paper's training data, about
ASSUMED_MFU = 0.35
LOADER_THREADS = 4  # transformers 5.x core_model_loading.GLOBAL_WORKERS (min(4, cpus))
STORAGE_BYTES = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float32": 4}
# in a results folder: the fields of a result written by hand, not by the tool that measured
HAND_EDITED = "hand_edited.json"
# what a GPU size should train with, cheapest first: DDP before FSDP (less communication), and
# gradient checkpointing (a third more layer FLOPs) only where needed
SETUPS = (("ddp", False), ("fsdp", False), ("ddp", "selective"), ("fsdp", "selective"), ("ddp", True), ("fsdp", True))
"""(train.distributed, train.gradient_checkpointing) in the order fitting_setup tries them."""


@dataclass
class Run:
    """The run the costs are for: how much data, how many passes, on what GPU at what efficiency."""

    sequences: int
    tokens_per_sequence: int
    sequences_where: str  # how `sequences` is known
    epochs: int = 6
    max_steps: int | None = None
    storage: str = "bfloat16"  # features.storage
    peak_tflops: float = 989.0  # dense bf16 of an H100 / H200 SXM
    mfu: float = ASSUMED_MFU
    mfu_where: str = "assumed: no GPU result with an MFU in bench/results/"
    # whether the step the MFU was measured on recomputed its layers (gradient checkpointing); None: as the planned
    # step does (an MFU given with mfu=); the assumed one is taken as a step's without
    mfu_recomputed: bool | None = False
    disk_tb: float = 20.0  # room for the feature cache: offline is recommended only when it fits


def cache_bytes_per_token(s: Shape, storage: str) -> int:
    """Bytes one token takes in the feature cache: features, token id (int32), loss mask (uint8), scales."""
    scales = 4 * s.target_layers if storage == "float8_e4m3fn" else 0
    return s.target_layers * s.hidden * STORAGE_BYTES[storage] + 4 + 1 + scales


def measured_mfu(results: Path, experiment: str | None = None,
                 composed: Callable[[tuple[str, ...]], bool] | None = None,
                 shown: str | None = None) -> tuple[float, str, bool] | None:
    """(MFU, where it is from, whether that step recomputed its layers), from the GPU results in `results` (files
    whose "device" is not cpu, named by date): with `experiment`, its own step where one was measured (a check whose
    "shape" starts with the overrides it ran, `experiment=<name>` among them: bench/gpu/steps.py's preset_step), of the
    newest date that has one, a step timed alone ("alone": true) before one timed beside other checks; else the
    median of the "mfu" values of the newest file holding any, of its steps measured without gradient checkpointing
    where it has such. (On the first H200 the Qwen3-8B-size steps ran at 0.33, the Qwen3.6-27B drafter's at 0.28,
    its DFlash 2 drafter's at 0.20 alone and 0.15 beside other checks, both with gradient checkpointing as their
    presets train: a plan for a preset counts its own.) `composed`: whether a preset step's overrides compose to
    full checkpointing (`recomputed`); `shown`: the folder's name in the words (default: its path)."""
    shown = shown or str(results)

    def measured(x, name="a step"):  # (check name, result) of each dict in x holding an "mfu" > 0
        if isinstance(x, dict):
            if isinstance(x.get("mfu"), (int, float)) and x["mfu"] > 0:
                yield name, x
            for k, v in x.items():
                yield from measured(v, k)
        elif isinstance(x, list):
            for v in x:
                yield from measured(v, name)

    def overrides(r) -> list[str]:  # the overrides a preset step ran: its shape before the ":"
        shape = r.get("shape")
        return shape.partition(":")[0].split() if isinstance(shape, str) else []

    files = []
    for path in results.glob("*.json"):
        data = tool_written(path)
        if isinstance(data, dict) and data.get("device", "cpu") != "cpu":
            files.append((path.name[:10], str(data.get("started", "")), path.name, path, data))
    median, steps = None, []
    # newest first: by the date the names start with, then by when a run started (a report says since it records it)
    for *_, path, data in sorted(files, key=lambda f: f[:3], reverse=True):
        found = [(name, r, recomputed(r, overrides(r), composed)) for name, r in measured(data)]
        plain = [r for _, r, ckpt in found if not ckpt]
        if found and median is None:
            mfus = [float(r["mfu"]) for r in plain or [r for _, r, _ in found]]
            median = (statistics.median(mfus), f"measured: median of {len(mfus)} in {shown}/{path.name}",
                      not plain)
        if experiment:
            steps += [(path.name[:10], bool(r.get("alone")), name, float(r["mfu"]), path.name, ckpt)
                      for name, r, ckpt in found if f"experiment={experiment}" in overrides(r)]
    if steps:
        date, alone, name, mfu, file, ckpt = max(steps, key=lambda t: t[:2])
        return mfu, (f"measured: {name}, experiment={experiment}'s step{' alone' if alone else ''}, in "
                     f"{shown}/{file}"), ckpt
    return median


def tool_written(path: Path):
    """A result file as the tool that measured it wrote it: its JSON less the fields HAND_EDITED (next to it) lists
    for it ("checks/*/alone": that key in every entry under "checks"); None when it does not parse, or for
    HAND_EDITED itself. A result is never edited afterwards; a file edited by hand before that rule keeps its
    bytes, and its notes file says what the hand added."""
    if path.name == HAND_EDITED:
        return None
    try:
        data = json.loads(path.read_text())
        hand = json.loads((path.parent / HAND_EDITED).read_text()) if (path.parent / HAND_EDITED).exists() else {}
    except (OSError, ValueError):
        return None

    def drop(x, keys: list[str]) -> None:
        if not isinstance(x, dict):
            return
        if len(keys) == 1:
            x.pop(keys[0], None)
            return
        for v in list(x.values()) if keys[0] == "*" else [x.get(keys[0])]:
            drop(v, keys[1:])

    for field in hand.get(path.name, {}).get("hand_written", []):
        drop(data, field.split("/"))
    return data


CHECKPOINTED_WHEN_MEASURED = {"qwen3_6_27b": True, "qwen3_6_27b_dflash2": True}
"""Presets whose steps were measured before preset_step recorded "checkpointing" (the 2026-12-04 H200 results, at
3072 tokens), and whether those steps checkpointed: the presets have changed since (32768 tokens, the target
sharded, no checkpointing), so their overrides composed today would misread the steps."""


def recomputed(result: dict, overrides: list[str], composed: Callable[[tuple[str, ...]], bool] | None = None) -> bool:
    """Whether a measured step ran with gradient checkpointing: its "checkpointing" (bench/gpu/steps.py's preset_step
    records it), else CHECKPOINTED_WHEN_MEASURED for its preset, else what its overrides compose to (`composed`, the
    configured adapter's reading: a preset step of an older result), else False (the flex steps at Qwen3-8B size
    never checkpoint)."""
    if isinstance(result.get("checkpointing"), bool) or result.get("checkpointing") == "selective":
        return result["checkpointing"] is True  # selective replays no matmul: no model FLOPs recomputed
    for o in overrides:
        if o.partition("=")[0] in ("experiment", "+experiment") and o.partition("=")[2] in CHECKPOINTED_WHEN_MEASURED:
            return CHECKPOINTED_WHEN_MEASURED[o.partition("=")[2]]
    return (composed is not None and bool(overrides) and all("=" in o for o in overrides)
            and composed(tuple(overrides)))


def loading_bytes(s: Shape, frozen: int) -> dict[str, float]:
    """Host memory of loading the target on one process (bytes): the tensors in flight, the page cache."""
    return {"process": sum(s.target_largest[:LOADER_THREADS]) * frozen,
            "page cache (shared by a node)": s.target_params * frozen,
            "heads only (offline training)": s.heads_params * frozen}


def recompute_scale(per: dict[str, float], planned: bool, measured: bool) -> float:
    """What the drafter's model FLOPs are multiplied by for the time they take at an MFU measured on a step that
    recomputed its layers (`measured`) or not, when the planned step does (`planned`) or not. An MFU is model FLOPs
    over the step's time, so a step that recomputes did its model FLOPs and the recompute in that time: at the same
    hardware rate the planned step takes (model + its recompute) / (model + the measured one's), the recompute's
    share taken at the planned shape. 1 when both or neither recompute."""
    model, extra = per["drafter"], per["recompute"]
    return (model + extra * planned) / (model + extra * measured)


def gpu_hours(per: dict[str, float], s: Shape, u: Setup, run: Run) -> dict[str, dict[str, float]]:
    """GPU-hours of the run, offline (extraction once, then training) and online (target every epoch); `per`: the
    FLOPs of one sequence of run.tokens_per_sequence tokens ({"drafter", "recompute", "target"}: the configured
    adapter's sequence_flops)."""
    full = u.checkpointing is True  # selective checkpointing replays no matmul: no model FLOPs recomputed
    measured = full if run.mfu_recomputed is None else run.mfu_recomputed
    drafter_flops = per["drafter"] * recompute_scale(per, full, measured)
    trained = (run.max_steps * u.batch * u.grad_accum * u.world if run.max_steps
               else run.epochs * run.sequences)
    rate = run.peak_tflops * 1e12 * run.mfu * 3600  # FLOPs a GPU-hour
    extraction = run.sequences * per["target"] / rate
    return {"offline": {"extraction": extraction, "training": trained * drafter_flops / rate,
                        "total": extraction + trained * drafter_flops / rate},
            "online": {"extraction": 0.0, "training": trained * (drafter_flops + per["target"]) / rate,
                       "total": trained * (drafter_flops + per["target"]) / rate},
            "flops_per_token": {"drafter": per["drafter"] / run.tokens_per_sequence,
                                "recompute": per["recompute"] * full / run.tokens_per_sequence,
                                "target forward": per["target"] / run.tokens_per_sequence},
            "recompute_scale": drafter_flops / per["drafter"]}


def fitting_setup(s: Shape, u: Setup, budget: float) -> dict:
    """The first of SETUPS whose step fits `budget` bytes at the configured num_anchors, with its peak; else
    the set-up that holds the most anchors and that count."""
    options = [(d, ckpt) for d, ckpt in SETUPS if d == "ddp" or u.world > 1]
    for d, ckpt in options:
        total = peak(s, replace(u, distributed=d, checkpointing=ckpt))[0]
        if total <= budget:
            return {"distributed": d, "checkpointing": ckpt, "num_anchors": u.num_anchors, "peak": total}
    best = max(options, key=lambda o: max_anchors(s, replace(u, distributed=o[0], checkpointing=o[1]), budget))
    w = replace(u, distributed=best[0], checkpointing=best[1])
    n = max_anchors(s, w, budget)
    return {"distributed": best[0], "checkpointing": best[1], "num_anchors": n,
            "peak": peak(s, replace(w, num_anchors=max(n, 1)))[0] if n else None}


def recommend(s: Shape, u: Setup, run: Run, cache_bytes: float, gpu_gb: list[float]) -> list[dict]:
    """Per GPU size: the set-up each mode fits with, and the mode to train in: offline where the cache fits
    run.disk_tb (one target forward a sequence instead of one an epoch), else online where it fits."""
    out, disk = [], cache_bytes <= run.disk_tb * 1e12
    for gb in gpu_gb:
        modes = {m: fitting_setup(s, replace(u, online=m == "online"), gb * GiB) for m in ("offline", "online")}
        fits = [m for m, f in modes.items() if f["num_anchors"] == u.num_anchors]
        cache = f"the cache ({cache_bytes / 1e12:.1f} TB) {'fits' if disk else 'exceeds'} disk_tb={run.disk_tb:g}"
        if len(fits) == 2:
            mode, why = ("offline" if disk else "online"), cache
        elif fits:
            mode, why = fits[0], f"only {fits[0]} fits num_anchors={u.num_anchors}; {cache}"
        else:  # neither: the mode that holds the most anchors (offline, without the target, where equal)
            mode = max(modes, key=lambda m: (modes[m]["num_anchors"], m == "offline"))
            why = f"num_anchors={u.num_anchors} fits neither mode: the most that fit; {cache}"
        out.append({"gpu_gib": gb, "mode": mode, "why": why, **modes[mode], "modes": modes})
    return out


def render_run(r: dict, world: int) -> list[str]:
    """The text lines of make_plan's "run" part: offline and online side by side, then the recommendation."""
    h, load, c = r["gpu_hours"], r["loading_gib"], r["cache_gb_per_million_tokens"]
    steps = f"max_steps {r['max_steps']}" if r["max_steps"] else f"{r['epochs']} epochs"
    per_token = h["flops_per_token"]
    cache = (f"{r['cache_tb']:.1f} TB in {r['storage']} ({c['bfloat16']:.1f} GB per million tokens in bf16, "
             f"{c['float8_e4m3fn']:.1f} in fp8)")
    heads, flight = load["heads only (offline training)"], load["process"]
    pages = load["page cache (shared by a node)"]
    offline_hours = (f"{h['offline']['extraction']:.0f} extraction + {h['offline']['training']:.0f} training = "
                     f"{h['offline']['total']:.0f}")
    online_load = (f"at most {flight:.1f} GiB in flight ({LOADER_THREADS} tensors), page cache up to {pages:.1f} "
                   f"GiB shared by a node")
    rows = [  # (what, offline, online)
        ("feature cache on disk", cache, "none"),
        ("host memory a process, loading", f"training reads embed + lm_head ({heads:.1f} GiB); extraction as online",
         online_load),
        ("GPU peak a process, configured", f"{r['peak_gib']['offline']:.1f} GiB", f"{r['peak_gib']['online']:.1f} GiB"),
        ("GPU-hours", offline_hours, f"{h['online']['total']:.0f} (the target's forward every epoch)"),
    ]
    head = (f"the run: {r['sequences']} sequences ({r['sequences_where']}) x {r['tokens_per_sequence']} tokens, "
            f"{steps}; MFU {r['mfu']:.0%} ({r['mfu_where']}), {r['peak_tflops']:g} TFLOP/s bf16 a GPU; FLOPs a "
            f"token: drafter step {per_token['drafter']:.3g}{recompute_words(h)}, target forward "
            f"{per_token['target forward']:.3g}")
    lines = ["", head]
    for name, offline, online in rows:
        lines += [f"  {name:<32} offline  {offline}", f"  {'':<32} online   {online}"]
    lines.append(f"recommended, {world} process{'es' if world > 1 else ''} a run (world_size):")
    for g in r["recommended"]:
        each = "; ".join(f"{m}: {describe(f)}" for m, f in g["modes"].items())
        lines += [f"  {g['gpu_gib']:>4g} GiB: {g['mode']}, {describe(g)} ({g['why']})", f"            {each}"]
    return lines


def describe(f: dict) -> str:
    """One set-up of fitting_setup in words."""
    if not f["num_anchors"]:
        return "fits no set-up"
    ckpt = {False: "", "selective": ", selective checkpointing", True: ", gradient checkpointing"}[f["checkpointing"]]
    return f"{f['distributed']}{ckpt}, num_anchors {f['num_anchors']}, peak {f['peak']:.1f} GiB"


def recompute_words(h: dict) -> str:
    """What gpu_hours did about gradient checkpointing's recompute, in words for render_run."""
    extra, scale = h["flops_per_token"]["recompute"], h["recompute_scale"]
    if extra and scale > 1:
        return f" (+{extra:.3g} recomputed, counted: the MFU's step did not recompute)"
    if extra:
        return f" (+{extra:.3g} recomputed, already in the time of the MFU's step, which recomputed too)"
    return f" (the MFU's step recomputed: its time x{scale:.3f} without)" if scale < 1 else ""
