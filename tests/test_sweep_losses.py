"""sweeps/losses_optim.sh: every arm composes and sets what it names (the sweep itself is not run here)."""

import re

import pytest

from tests.conftest import REPO, compose

SCRIPT = (REPO / "sweeps/losses_optim.sh").read_text()
ARMS = dict(re.findall(r'^\s+\[(\w+)\]="([^"]+)"', SCRIPT, flags=re.MULTILINE))


def test_the_script_lists_the_five_arms_of_issue_30():
    assert set(ARMS) == {"decay_ce", "dpace", "dpace_w", "kl", "muon"}
    assert re.search(r'SEEDS=\$\{SEEDS:-"0 1 2"\}', SCRIPT)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_each_arm_composes(arm):
    job = compose("train", ARMS[arm].split() + ["train.seed=2", f"run.name={arm}-s2"])
    assert job.train.seed == 2
    expected = {"decay_ce": ("decay_ce", "weights", "adamw"), "dpace": ("dpace", "anchor", "adamw"),
                "dpace_w": ("dpace", "weights", "adamw"), "kl": ("kl", "weights", "adamw"),
                "muon": ("decay_ce", "weights", "muon")}[arm]
    assert (job.loss.objective, job.loss.normalizer, job.optim.name) == expected
    assert job.train.mode == ("online" if arm == "kl" else "offline")
    assert job.train.max_steps == compose("train", []).train.max_steps  # equal steps: the recipe's
