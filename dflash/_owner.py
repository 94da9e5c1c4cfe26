"""Who else provides `import dflash`: said once, in one line, at import.

This project's distribution is dflash-train. The z-lab reference decoder's wheel on PyPI is named dflash and
installs the same top-level package: with both on the path, `import dflash` gives whichever comes first on
sys.path, and installed into one site-packages their files overwrite each other. `import dflash` warns when
it finds a distribution named dflash: the z-lab wheel, or this checkout's own editable install (and its
dflash.egg-info) from before the rename in 0.2.0. The look-up lists each sys.path directory: `import dflash`
takes 2 ms longer, plus importlib.metadata's own import (20 ms, which torch needs anyway). packages_distributions()
would also catch a third name shipping `dflash`, but reads every installed distribution's file list: 120 ms.

Silence it with `python -W ignore::UserWarning:dflash` (the warning is raised from the module `dflash`).
"""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "dflash-train"
"""This project's distribution name (pyproject.toml [project].name)."""

REFERENCE = "dflash"
"""The z-lab reference decoder's distribution name: it installs `import dflash` too."""

PACKAGE = Path(__file__).resolve().parent
"""The `dflash` package this module was imported from."""


class ImportNameConflictWarning(UserWarning):
    """Another installed distribution also provides `import dflash`."""


def _editable_checkout(dist: importlib.metadata.Distribution) -> Path | None:
    """The directory an editable install points at (PEP 610 direct_url.json), or None if not editable."""
    import json  # only when a conflicting distribution is found

    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return None
    if not direct.get("dir_info", {}).get("editable"):
        return None
    return Path(unquote(urlparse(direct.get("url", "")).path)).resolve()


def _describe(dist: importlib.metadata.Distribution) -> str:
    """What to say about one other distribution that provides `import dflash`, and the fix."""
    name, version, where = dist.metadata["Name"], dist.version, Path(dist.locate_file("")).resolve()
    parent = PACKAGE.parent  # this checkout, or the site-packages this dflash is installed in
    if _editable_checkout(dist) == parent:
        return (f"{name} {version}, an editable install of this checkout under its name before the rename to "
                f"{DISTRIBUTION}, also provides `import dflash`: remove it with `pip uninstall {name}`")
    if where == parent and (parent / "pyproject.toml").exists():
        # setuptools' metadata of an old editable build, found when the checkout is on sys.path
        stale = Path(getattr(dist, "_path", where)).resolve()
        return (f"{stale}, metadata of this checkout under its name before the rename to {DISTRIBUTION} "
                f"({name} {version}), says another distribution provides `import dflash`: delete it")
    if where == parent:
        return (f"{name} {version} (the z-lab reference decoder's name) is installed in {where} beside "
                f"{DISTRIBUTION}, and the two overwrite each other's files of `import dflash`: pip uninstall both, "
                f"then install each in a venv of its own (docs/reference_decoder.md)")
    return (f"{name} {version} in {where} (the z-lab reference decoder's name) also provides `import dflash`, as "
            f"does {DISTRIBUTION} ({PACKAGE}): which one `import dflash` gives depends on sys.path order. Keep "
            f"the two in separate venvs (docs/reference_decoder.md)")


def conflicts() -> list[str]:
    """One sentence for each other distribution that provides `import dflash` on sys.path (none: [])."""
    seen, out = set(), []
    for dist in importlib.metadata.distributions(name=REFERENCE):
        key = (dist.metadata["Name"], dist.version, str(dist.locate_file("")))
        if key not in seen:  # a directory listed twice on sys.path yields its distributions twice
            seen.add(key)
            out.append(_describe(dist))
    return out


def warn_if_shared() -> None:
    """Warn, in one line, when another distribution also provides `import dflash` (called by dflash/__init__)."""
    found = conflicts()
    if found:
        warnings.warn("; ".join(found), ImportNameConflictWarning, stacklevel=2)
