"""What an evaluation's figures depend on, and the folder they land in.

Every evaluation records its settings in summary.json (`settings`: {config key: value}, `figure_settings`): the
held-out set (prompts, how many, their budget, the chat template, the target), how blocks are scored (anchors,
DDTree budgets, slices, the dtype), the suite and its protocol, sampling, live decoding's verifier and serving
model. Keys that do not change the figures (plots, eval.compare, logging, paths of caches) are not settings.

A checkpoint's results go to eval/<step>[-live][-<tag>]/ (`evaluation_folder`). The tag is empty at the run's
own settings, the ones its in-run evaluation used (config.yaml, read as the in-run evaluation reads it: teacher-
forced, eval.prompts, no suite); else it names, a word per setting (`settings_tag`), where this evaluation's
differ: step-000120-2prompts, step-000120-t1-k20 (sampling: `sampling_tag`), step-000120-bfloat16,
step-000120-live-24tokens. So an evaluation at other settings lands beside the run's own, never over it, and the
run's curve (RunLayout.step_evaluations: eval/step-<digits>) keeps the in-run settings. The same tag is the
namespace of the metrics it logs (eval/2prompts/tau), so they stay off the run's eval/* curves too (a suite's
metrics are its own already, eval/<bench>/*: only sampling namespaces them, eval/t1/<bench>/*).

A folder is rewritten only by an evaluation whose settings equal the ones its summary.json records (the same
figures; write_outputs keeps the earlier one under a dated name); a folder recording other settings (a word that
could not tell two apart: two prompt files of one name; a folder written before settings were recorded) is left
as it is and the evaluation takes the next free <name>-2, <name>-3. Outside a run (a drafter folder of its own)
the first evaluation under a name plays the run's part, greedy: a later one at other settings is tagged against it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

from dflash.config import DataConfig, EvalConfig, TargetConfig, migrate_settings

log = logging.getLogger(__name__)

SAMPLING = ("eval.decode.temperature", "eval.decode.top_p", "eval.decode.top_k", "eval.decode.selector_draw",
            "eval.decode.selector_truncation")
"""The keys of the draft and target distributions at temperature > 0: together one word, the sampling tag."""
IDENTITY = ("target.name", "target.path", "target.revision", "target.build", "target.num_layers")
"""Which target: one word."""
SUITE = ("eval.suite.name", "eval.suite.benchmarks_dir", "eval.suite.protocol", "eval.suite.thinking")
"""A suite's: only with eval.suite."""
OWN_PROMPTS = ("eval.prompts", "eval.completions_path", "eval.turns")
"""The single held-out set's: a suite's benchmarks bring their own prompts and turns."""
SCORING = ("eval.anchor_region", "eval.anchor_stride", "eval.max_blocks")
"""Teacher-forced only: which blocks are scored."""
LIVE = ("eval.decode.tie_margin", "eval.decode.warmup_tokens", "eval.serving.gpu", "eval.serving.concurrency")
"""Live decoding only (eval.decode.verifier too, at temperature > 0)."""
SAMPLED = ("eval.decode.top_p", "eval.decode.top_k", "eval.decode.selector_draw", "eval.decode.selector_truncation",
           "eval.decode.seed")
"""Read at temperature > 0 only (eval.topk_logits too, teacher-forced)."""
COMMON = ("eval.max_prompts", "eval.max_new_tokens", "eval.completions_batch_size", "eval.ddtree_budgets",
          "eval.slices", "eval.decode.selector_beam", "eval.decode.temperature", "eval.dtype", "target.dtype",
          "data.chat_template", "data.enable_thinking", "data.chat_template_kwargs", "data.completions.stop",
          "data.tools.keep_results", "data.sources")
"""Read by every evaluation."""
KEYS = (*IDENTITY, *SUITE, *OWN_PROMPTS, *SCORING, *LIVE, *SAMPLED, *COMMON, "eval.decode.verifier", "eval.topk_logits",
        "eval.mode")


def _stem(value) -> str:
    return Path(str(value).removeprefix("builtin:")).stem


def _switch(value) -> str:
    return {True: "on", False: "off", None: "default"}[value]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:6]


def _auto(value) -> str:
    return "-auto" if value is None else str(value)


def _join(values, empty: str) -> str:
    return "-".join(map(str, values)) or empty


WORDS = {  # one word per setting (or group), in the order they appear in a tag
    SAMPLING: lambda s: sampling_tag(SimpleNamespace(**{k.removeprefix("eval.decode."): s.get(k, _default(k))
                                                         for k in SAMPLING})) or "t0",
    ("eval.decode.seed",): lambda s: f"seed{s['eval.decode.seed']}",
    ("eval.topk_logits",): lambda s: f"topk{s['eval.topk_logits']}",
    ("eval.decode.verifier",): lambda s: f"verify-{s['eval.decode.verifier']}",
    ("eval.suite.name",): lambda s: f"suite-{s['eval.suite.name']}",
    ("eval.suite.benchmarks_dir",): lambda s: f"from-{_stem(s['eval.suite.benchmarks_dir'])}",
    ("eval.suite.protocol",): lambda s: f"protocol-{s['eval.suite.protocol']}",
    ("eval.suite.thinking",): lambda s: f"reasoning-{_switch(s['eval.suite.thinking'])}",
    ("eval.prompts",): lambda s: f"prompts-{_stem(s['eval.prompts'])}",
    ("eval.completions_path",): lambda s: f"completions-{_stem(s['eval.completions_path'] or 'generated')}",
    ("eval.turns",): lambda s: f"turns-{s['eval.turns']}",
    ("eval.max_prompts",): lambda s: f"{s['eval.max_prompts'] or 'all'}prompts",
    ("eval.max_new_tokens",): lambda s: f"{s['eval.max_new_tokens']}tokens",
    ("eval.completions_batch_size",): lambda s: f"batch{s['eval.completions_batch_size']}",
    ("eval.anchor_region",): lambda s: f"anchors-{s['eval.anchor_region']}",
    ("eval.anchor_stride",): lambda s: f"stride{s['eval.anchor_stride']}",
    ("eval.max_blocks",): lambda s: f"{s['eval.max_blocks'] or 'all'}blocks",
    ("eval.ddtree_budgets",): lambda s: f"ddtree-{_join(s['eval.ddtree_budgets'], 'none')}",
    ("eval.slices",): lambda s: f"slices-{_join(s['eval.slices'], 'none')}",
    ("eval.decode.selector_beam",): lambda s: f"beam{s['eval.decode.selector_beam']}",
    ("eval.dtype",): lambda s: s["eval.dtype"],
    ("eval.decode.tie_margin",): lambda s: f"ties{_auto(s['eval.decode.tie_margin'])}",
    ("eval.decode.warmup_tokens",): lambda s: f"warmup{s['eval.decode.warmup_tokens']}",
    ("eval.serving.gpu",): lambda s: f"serving-{s['eval.serving.gpu']}",
    ("eval.serving.concurrency",): lambda s: f"at-{_join(s['eval.serving.concurrency'], 'none')}",
    ("target.name",): lambda s: f"target-{s['target.name']}",
    IDENTITY[1:]: lambda s: f"target-{_digest([s.get(k) for k in IDENTITY])}",
    ("target.dtype",): lambda s: f"target-{s['target.dtype']}",
    ("data.chat_template",): lambda s: f"template-{_switch(s['data.chat_template'])}",
    ("data.enable_thinking",): lambda s: f"thinking-{_switch(s['data.enable_thinking'])}",
    ("data.chat_template_kwargs",): lambda s: f"kwargs-{_digest(s['data.chat_template_kwargs'])}",
    ("data.completions.stop",): lambda s: f"stop-{_digest(s['data.completions.stop'])}",
    ("data.tools.keep_results",): lambda s: f"toolresults-{_switch(s['data.tools.keep_results'])}",
    ("data.sources",): lambda s: f"sources-{_digest(s['data.sources'])}",
}
"""What a tag says of each setting that differs (eval.mode is the -live suffix itself, no word)."""
MAX_TAG = 120
"""Longer tags keep their first words and a digest of the rest: a folder name has room for 255 bytes."""


def job_config(job) -> dict:
    """The groups of a JobConfig that settings read, as plain nested dicts (config.yaml's shape)."""
    return {group: asdict(getattr(job, group)) for group in ("eval", "data", "target")}


def figure_settings(cfg: dict, in_run: bool = False) -> dict:
    """{config key: value} of every setting an evaluation's figures depend on, from a config's groups as plain nested
    dicts (job_config, or a run's config.yaml; a key that file does not have takes the schema's default, what the
    dflash that wrote it did). eval.dtype resolved (auto: the target's). in_run: the evaluation training runs, on
    eval.prompts teacher-forced whatever eval.mode and eval.suite.name say. JSON-plain, as summary.json gives it
    back."""
    every = {key: _read(cfg, key) for key in KEYS}
    if in_run:
        every.update({"eval.mode": "teacher_forced", "eval.suite.name": None})
    if every["eval.dtype"] == "auto":
        every["eval.dtype"] = every["target.dtype"]
    if every["target.build"]:  # a built target's path is where its weights were built ($DFLASH_HOME), not which
        every["target.path"] = None
    live, suite = every["eval.mode"] == "live", every["eval.suite.name"] is not None
    sampled = every["eval.decode.temperature"] > 0
    keep = {"eval.mode", *IDENTITY, *COMMON, *(SUITE if suite else OWN_PROMPTS), *(LIVE if live else SCORING),
            *(SAMPLED if sampled else ()), *(["eval.decode.verifier"] if live and sampled else ()),
            *(["eval.topk_logits"] if sampled and not live else ())}
    return json.loads(json.dumps({k: v for k, v in every.items() if k in keep}, default=str))


def reference_settings(cfg: dict) -> dict:
    """The run's own settings (its in-run evaluation's) for every key, read where not in effect there too (a live
    key, a suite's): what a setting of another evaluation is told apart from."""
    every = {key: _read(cfg, key) for key in KEYS}
    return json.loads(json.dumps({**every, **figure_settings(cfg, in_run=True)}, default=str))


def settings_tag(settings: dict, reference: dict, keys: tuple | None = None) -> str:
    """'' where `settings` (figure_settings) equal the reference's; else a word per group of WORDS with a key that
    differs, joined by '-' (2prompts-bfloat16, t1-k20-seed1, suite-zlab-2048tokens); of `keys` only, when given."""
    differ = {k for k, v in settings.items() if k != "eval.mode" and (keys is None or k in keys)
              and v != reference.get(k, _default(k))}
    if "target.name" in differ:  # another target by name: its path, revision and build go with the name's word
        differ -= set(IDENTITY)
        differ.add("target.name")
    words = [re.sub(r"[^A-Za-z0-9_.+-]+", "_", word(settings)) for group, word in WORDS.items() if differ & set(group)]
    tag = "-".join(words)
    return tag if len(tag) <= MAX_TAG else f"{tag[:MAX_TAG - 7]}-{_digest(settings)}"


def sampling_tag(cfg) -> str:
    """'' at temperature 0; else t<T>[-p<top_p>][-k<top_k>][-sel][-vocabulary|-unary]: the sampling settings' word of
    a tag (eval/step-000768-t1/, eval/t1/tau_expected, eval/t1/live_tau), so a greedy and a sampled evaluation of one
    checkpoint never share a curve or the run's best eval/tau. `-sel`: top-p / top-k applied to DFlash 2's draw too
    (eval.decode.selector_truncation); `-vocabulary`, `-unary`: DFlash 2 drawing over another set
    (eval.decode.selector_draw); each another draft distribution. cfg: eval.decode (DecodeConfig)."""
    if cfg.temperature <= 0:
        return ""
    truncated = cfg.top_p < 1 or cfg.top_k
    return (f"t{cfg.temperature:g}" + (f"-p{cfg.top_p:g}" if cfg.top_p < 1 else "")
            + (f"-k{cfg.top_k}" if cfg.top_k else "") + ("-sel" if truncated and cfg.selector_truncation else "")
            + ("" if cfg.selector_draw == "candidates" else f"-{cfg.selector_draw}"))


def recorded(folder: Path) -> dict | None:
    """The settings an evaluation folder's summary.json records; {} for a folder without one (nothing finished
    there), None for a summary.json that records none (written before settings were)."""
    summary = folder / "summary.json"
    if not summary.is_file():
        return {}
    return migrate_settings(json.loads(summary.read_text()).get("settings"))  # keys that moved: their new names


def evaluation_folder(eval_root: Path, base: str, settings: dict, reference: dict | None) -> tuple[Path, str]:
    """(the folder under eval_root an evaluation writes, the namespace of its metrics) for `base` (step-000120,
    step-000120-live, a drafter's name): <base>[-<tag>], the tag against `reference` (the run's own settings; None
    outside a run: the settings recorded by the first evaluation at <base>, greedy); then, where that folder records
    other settings (or none), the first of <name>-2, <name>-3, ... that is free or records these. The namespace is
    the tag; a suite's, its sampling word alone: its metrics are its own already (eval/<bench>/*, eval/mean/*), and
    keep the names they are known by (eval/gsm8k/tau, eval/t1/gsm8k/tau_expected)."""
    what = "the run's own"
    if reference is None:  # greedy, as evaluations are by default: a sampled one is tagged (t1) from the first
        first, what = recorded(eval_root / base) or settings, f"the first evaluation's, in {eval_root / base}"
        reference = {**reference_settings({}), **{k: v for k, v in first.items() if k not in SAMPLED},
                     "eval.decode.temperature": 0.0}
    tag = settings_tag(settings, reference)
    name = f"{base}-{tag}" if tag else base
    n = 1
    while True:
        folder = eval_root / (name if n == 1 else f"{name}-{n}")
        there = recorded(folder)
        if not folder.exists() or there == {} or there == settings:
            break
        n += 1
    namespace = tag if settings.get("eval.suite.name") is None else settings_tag(settings, reference, SAMPLING)
    if tag:  # said, since the run's curve will not show these figures
        log.info("settings other than %s (%s): results in %s%s", what, differences(settings, reference), folder,
                 f", metrics as eval/{namespace}/*" if namespace else "")
    if n > 1:
        log.info("%s holds an evaluation at other settings (or at settings it does not record): this one goes to %s",
                 eval_root / name, folder)
    return folder, namespace


def differences(settings: dict, reference: dict) -> str:
    """`key: <reference> there, <this> here` for each setting that differs, comma-separated (for the log)."""
    return ", ".join(f"{k}: {reference.get(k, _default(k))!r} there, {v!r} here" for k, v in settings.items()
                     if k != "eval.mode" and v != reference.get(k, _default(k)))


def _read(cfg: dict, key: str):
    """cfg's value of a dotted key, the schema's default where cfg has none."""
    value = cfg
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _default(key)
        value = value[part]
    return value


def _default(key: str):
    """The schema's default of a dotted key (its dataclass field's default or default_factory); None if it has none."""
    group, *parts = key.split(".")
    cls = {"eval": EvalConfig, "data": DataConfig, "target": TargetConfig}[group]
    field = {f.name: f for f in fields(cls)}[parts[0]]
    value = field.default_factory() if field.default_factory is not MISSING else field.default
    for part in parts[1:]:
        value = getattr(value, part)
    if is_dataclass(value):
        value = asdict(value)
    return None if value is MISSING or value == "???" else value
