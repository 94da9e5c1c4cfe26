"""Labels of the evaluated drafters (dflash.evaluate.runner.drafter_labels): one per drafter, never shared."""

from pathlib import Path

import pytest

from dflash.errors import ConfigError
from dflash.evaluate.runner import drafter_labels, folder_name

CKPT = Path("/runs/r1/checkpoints/step-000768")


def labels(compare, checkpoint=CKPT, own="step768"):
    return [label for label, _ in drafter_labels(checkpoint, own, compare)]


def test_distinct_folders_keep_their_names():
    assert labels(["/models/zlab-b16", "/runs/r2/export"]) == ["step768", "zlab-b16", "export"]


def test_folders_of_one_name_take_the_shortest_suffix_that_tells_them_apart():
    assert labels(["/x/run_a/export", "/x/run_b/export", "/x/other"]) == [
        "step768", "run_a/export", "run_b/export", "other"]
    assert labels(["/p/q/e", "/r/q/e", "/s/e"]) == ["step768", "p/q/e", "r/q/e", "s/e"]
    assert folder_name("run_a/export") == "run_a__export"


def test_a_checkpoint_that_clashes_with_a_compared_drafter_takes_its_path_too():
    ckpt = Path("/x/run_a/export")  # a foreign drafter: labelled by its folder
    assert labels(["/x/run_b/export"], ckpt, "export") == ["run_a/export", "run_b/export"]
    assert labels(["/y/step768"]) == ["step-000768", "y/step768"]  # a folder named like the step


def test_name_equals_path_sets_the_label(tmp_path):
    assert labels(["a=/x/run_a/export", "b=/x/run_b/export"]) == ["step768", "a", "b"]
    assert drafter_labels(CKPT, "step768", ["a=~/x"])[1] == ("a", Path("~/x").expanduser())
    assert labels(["export=/x/run_a/export", "/x/run_b/export"]) == ["step768", "export", "run_b/export"]
    assert labels(["step768=/x/mine"]) == ["step-000768", "step768"]  # a name outranks the checkpoint's label
    folder = tmp_path / "lr=3e-4"  # an existing folder is a path, '=' or not
    folder.mkdir()
    assert labels([str(folder)]) == ["step768", "lr=3e-4"]
    assert labels(["x=y/z"])[1] == "x" and labels(["/a/b=c"])[1] == "b=c"  # '/' before the '=': a path


@pytest.mark.parametrize("compare, match", [
    (["/x/e", "/x/e"], r"^eval.compare: '/x/e' and '/x/e' are the same folder; name the compared drafters "
                       r"apart as name=path, e.g. eval.compare='\[\"mine=/x/e\"\]'$"),
    (["/x/e", "/y/../x/e"], r"'/x/e' and '/y/../x/e' are the same folder;"),
    (["a=/x/e", "a=/y/e"], r"'a=/x/e' and 'a=/y/e' would both be labelled 'a';"),
    (["/a/b", "/c/b", "a__b=/x/e"], r"'/a/b' and 'a__b=/x/e' would share a results folder \('a/b', 'a__b'\);"),
    (["=/x/e"], r"eval.compare entry '=/x/e': expected name=path"),
    (["a="], r"eval.compare entry 'a=': expected name=path"),
])
def test_a_label_two_drafters_would_share_is_refused_in_one_line(compare, match):
    with pytest.raises(ConfigError, match=match) as e:
        labels(compare)
    assert "\n" not in str(e.value)


def test_the_checkpoint_given_again_is_refused():
    with pytest.raises(ConfigError, match=r"^eval.compare: checkpoint=/x/export and '/x/export' are the same "
                                          r"folder; name the compared drafters apart as name=path"):
        labels(["/x/export"], Path("/x/export"), "export")
