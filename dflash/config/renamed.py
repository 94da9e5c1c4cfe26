"""Keys that moved into sub-groups: refused on the command line in one line naming the new key; read under their new
names from what earlier runs saved (config.yaml, summary.json's settings), so nothing saved before is lost.

EvalConfig's sampling, verification and DFlash 2's draw went to eval.decode, a suite's keys to eval.suite, the
serving model's to eval.serving, and LossConfig's twelve selector_* keys to loss.selector.
"""

from __future__ import annotations

from dflash.config.checks import ConfigError

_DECODE = ("temperature", "top_p", "top_k", "seed", "verifier", "selector_draw", "selector_truncation",
           "selector_beam", "tie_margin", "warmup_tokens")
_SUITE = {"suite": "name", "benchmarks_dir": "benchmarks_dir", "references": "references", "protocol": "protocol",
          "thinking": "thinking"}
_SELECTOR = ("weight", "gradient", "gold", "warmup_ratio", "ramp_ratio", "init", "weights", "labels", "decay",
             "dropout", "shrink", "span")

RENAMED = {**{f"eval.{k}": f"eval.decode.{k}" for k in _DECODE},
           **{f"eval.{old}": f"eval.suite.{new}" for old, new in _SUITE.items()},
           "eval.serving_gpu": "eval.serving.gpu", "eval.serving_concurrency": "eval.serving.concurrency",
           **{f"loss.selector_{k}": f"loss.selector.{k}" for k in _SELECTOR}}
"""{old key: new key}."""


def refuse_renamed(overrides: list[str]) -> None:
    """Stop at the first command-line override (key=value, +key=value, ~key, a sweep's key=a,b) of a moved key,
    naming the new one with the value given. eval.suite itself is a group now: eval.suite=paper is refused,
    eval.suite.name=paper is the key."""
    for override in overrides:
        bare = override.lstrip("+~")
        key, eq, value = bare.partition("=")
        if key in RENAMED and not value.lstrip().startswith("{"):  # eval.suite={name: paper, ...}: the group, today's
            sign = override[:len(override) - len(bare)]
            raise ConfigError(f"{key} is now {RENAMED[key]}: write {sign}{RENAMED[key]}{eq}{value}")


def migrate_tree(tree: dict) -> dict:
    """A saved config (config.yaml as nested dicts) with its moved keys under their new names; a key already under
    its new name wins. The tree given is not changed."""
    out = {group: dict(values) if isinstance(values, dict) else values for group, values in tree.items()}
    for old, new in RENAMED.items():  # eval.suite (the old string) comes before the suite's other keys
        group, key = old.split(".")
        values = out.get(group)
        if not isinstance(values, dict) or key not in values or isinstance(values[key], dict):
            continue  # not there, or eval.suite already the group
        value = values.pop(key)
        _, sub, leaf = new.split(".")
        moved = values.get(sub) if isinstance(values.get(sub), dict) else {}
        values[sub] = {leaf: value, **moved}
    return out


def migrate_settings(settings: dict | None) -> dict | None:
    """Flat {config key: value} settings (summary.json's) with moved keys under their new names (where both are
    there, the new one's value)."""
    if settings is None:
        return None
    out = {k: v for k, v in settings.items() if k not in RENAMED}
    for old, value in settings.items():
        if old in RENAMED:
            out.setdefault(RENAMED[old], value)  # a key already under its new name wins, as in migrate_tree
    return out
