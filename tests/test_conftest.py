"""tests/conftest.py's pytest-xdist scheduling: whole modules per worker, every module that launches several
processes in the one "launch" unit (two launches at once would meet on the launcher's port 29500)."""

import re

from tests.conftest import LAUNCHING, REPO, scheduling_unit

LAUNCHERS = ("accelerate.commands" + ".launch", "torch.distributed" + ".run")  # split: this file launches nothing


def launching_modules() -> set[str]:
    """Test modules whose tests start a launcher, or that import from one that does (its launch helpers)."""
    sources = {p.relative_to(REPO).as_posix(): p.read_text() for p in (REPO / "tests").rglob("test_*.py")}
    found = {m for m, text in sources.items() if any(x in text for x in LAUNCHERS)}
    while True:
        more = {m for m, text in sources.items() if m not in found and any(
            re.search(rf"from {re.escape(f.removesuffix('.py').replace('/', '.'))} import", text) for f in found)}
        if not more:
            return found
        found |= more


def test_every_module_that_launches_processes_is_scheduled_as_one_unit():
    assert launching_modules() == LAUNCHING
    assert {scheduling_unit(f"{m}::test_x[a]") for m in LAUNCHING} == {"launch"}


def test_any_other_module_is_a_unit_of_its_own():
    assert scheduling_unit("tests/test_layout.py::test_run_paths") == scheduling_unit("tests/test_layout.py::test_b[1]")
    assert scheduling_unit("tests/test_layout.py::test_run_paths") == "tests/test_layout.py"
    assert scheduling_unit("tests/test_config.py::test_x") == "tests/test_config.py"
