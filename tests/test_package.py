"""The distribution is not named dflash (the z-lab reference decoder's wheel is), and `import dflash` says, in one
line, when another distribution named dflash is on the path. Fake distributions are real dist-info folders in
tmp_path, found by the real importlib.metadata look-up."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dflash import _owner

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name (how pip and PyPI compare names)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def fake_dist(site: Path, name: str, version: str, direct_url: dict | None = None, suffix: str = "dist-info"):
    """A minimal installed distribution `name` `version` providing the top-level package dflash, in `site`."""
    info = site / f"{canonical(name).replace('-', '_')}-{version}.{suffix}"
    info.mkdir(parents=True)
    (info / ("PKG-INFO" if suffix == "egg-info" else "METADATA")).write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("dflash\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_distribution_name_is_not_the_references():
    name = pyproject()["name"]
    assert re.fullmatch(r"[A-Z0-9]([A-Z0-9._-]*[A-Z0-9])?", name, re.IGNORECASE), f"{name!r}: not a valid name"
    assert canonical(name) != canonical(_owner.REFERENCE), "pip would replace the z-lab wheel with ours, and back"
    assert name == _owner.DISTRIBUTION


def test_provenance_records_our_distribution():
    from dflash.provenance import library_versions

    versions = library_versions()
    assert _owner.REFERENCE not in versions, "would record the z-lab wheel's version when it is installed"
    assert versions[_owner.DISTRIBUTION] in (None, pyproject()["version"]), \
        "stale install: pip install -e . again"


@pytest.mark.parametrize("case, expected", [
    ("reference", ["dflash 0.1.0 in {site}", "depends on sys.path order", "docs/reference_decoder.md"]),
    ("same_site_packages", ["dflash 0.1.0", "installed in {site} beside dflash-train", "overwrite each other"]),
    ("old_editable", ["dflash 0.1.0, an editable install of this checkout", "pip uninstall dflash"]),
    ("stale_egg_info", ["{site}/dflash-0.1.0.egg-info", "delete it"]),
])
def test_warns_in_one_line_naming_the_other_distribution(tmp_path, monkeypatch, case, expected):
    site = tmp_path / "site"
    fake_dist(site, "dflash-train", "0.2.0")
    if case == "old_editable":
        fake_dist(site, "dflash", "0.1.0", {"url": _owner.PACKAGE.parent.as_uri(), "dir_info": {"editable": True}})
    elif case == "stale_egg_info":  # setuptools' egg-info of an old editable build, in the checkout root
        fake_dist(site, "dflash", "0.1.0", suffix="egg-info")
        (site / "pyproject.toml").touch()
    else:
        fake_dist(site, "dflash", "0.1.0")
    if case in ("same_site_packages", "stale_egg_info"):  # ours imported from beside the other's metadata
        monkeypatch.setattr(_owner, "PACKAGE", site / "dflash")
    monkeypatch.setattr(sys, "path", [str(site), str(site)])  # listed twice: still said once
    with pytest.warns(_owner.ImportNameConflictWarning) as record:
        _owner.warn_if_shared()
    assert len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message
    for part in expected:
        assert part.format(site=site) in message


def test_silent_when_only_ours_is_installed(tmp_path, monkeypatch):
    fake_dist(tmp_path, "dflash-train", "0.2.0")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _owner.warn_if_shared()


def test_import_dflash_from_the_checkout_warns_once(tmp_path):
    """The real `import dflash`, from this checkout, with the z-lab wheel's metadata on PYTHONPATH."""
    fake_dist(tmp_path, "dflash", "0.1.0")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", "import dflash; print(dflash.__file__)"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == ROOT / "dflash" / "__init__.py"
    lines = [line for line in run.stderr.splitlines() if "ImportNameConflictWarning" in line]
    assert len(lines) == 1 and f"dflash 0.1.0 in {tmp_path}" in lines[0], run.stderr
