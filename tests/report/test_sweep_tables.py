"""sweeps/selector_table.py groups runs into arms as dflash.report does (by config, seeds apart), not by name."""

import importlib.util
import json

import yaml

from tests.conftest import REPO


def selector_table():
    spec = importlib.util.spec_from_file_location("selector_table", REPO / "sweeps/selector_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(root, name, kind, seed, tau, per_prompt, evaluated=True):
    """A run folder as training leaves it: config.yaml, metrics.jsonl with two log windows, and the in-run
    evaluation at its last step."""
    run = root / name
    run.mkdir(parents=True)
    config = {"drafter": {"kind": kind}, "train": {"seed": seed, "batch_size": 2, "num_anchors": 4, "grad_accum": 1},
              "run": {"name": name}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    windows = [{"step": s, "train/tau": tau / 2, "train/anchors_per_s": 8.0} for s in (50, 100)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    if evaluated:
        (run / "eval" / "step-000100").mkdir(parents=True)
        summary = {"mode": "teacher_forced", "step": 100, "metrics": {"eval/tau": tau, "eval/acc@1": 0.5},
                   "per_prompt": {p: {"tau": t} for p, t in per_prompt.items()}}
        (run / "eval" / "step-000100" / "summary.json").write_text(json.dumps(summary))


def test_arms_are_the_configs_less_the_seed_and_named_by_their_runs(tmp_path, capsys):
    """Two arms of two seeds each; the names say the arm (<arm>-s<seed>, as selector.sh names runs) but the
    grouping is the config's: a run of the dflash config whose name does not end in -s<seed> still joins its arm
    (its arm is then named by its config, as dflash.report labels it); a run not evaluated yet is left out."""
    fake_run(tmp_path, "dflash-s0", "dflash", 0, 2.0, {"a": 2.0, "b": 2.0})
    fake_run(tmp_path, "dflash-s1", "dflash", 1, 3.0, {"a": 3.0, "b": 3.0})
    fake_run(tmp_path, "ours-s0", "dflash2", 0, 2.5, {"a": 3.0, "b": 1.0})
    fake_run(tmp_path, "ours-s1", "dflash2", 1, 3.5, {"a": 3.5, "b": 3.5})
    fake_run(tmp_path, "ours-s2", "dflash2", 2, 9.0, {}, evaluated=False)
    selector_table().main(str(tmp_path))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"dflash", "ours"}
    assert rows["dflash"][1] == "0,1" and rows["dflash"][2].startswith("2.500 (0.707)")
    assert rows["ours"][1] == "0,1" and rows["ours"][2].startswith("3.000 (0.707)")
    assert rows["ours"][-2] == "3 / 1"  # vs dflash, prompt by prompt and seed by seed: a +1.0 win, b -1.0 loss
    fake_run(tmp_path, "dflash-rerun", "dflash", 2, 4.0, {"a": 4.0, "b": 4.0})
    selector_table().main(str(tmp_path))
    rows = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines()[2:]]
    assert ["| drafter.kind=dflash", "0,1,2"] in rows  # grouped by its config; named by it, the names differ


def test_the_acceptance_table_groups_the_same_way(tmp_path, capsys):
    """sweeps/acceptance_table.py: arms by config (seeds apart), the greedy walk tau of eval/step-000768 and the
    expected one at temperature 1 of eval/step-000768-t1; an extra root renames its dflash arm (root=arm)."""
    spec = importlib.util.spec_from_file_location("acceptance_table", REPO / "sweeps/acceptance_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    for name, kind, seed, tau in (("dflash-s0", "dflash", 0, 2.0), ("dflash-s1", "dflash", 1, 3.0),
                                  ("ours-s0", "dflash2", 0, 4.0)):
        fake_run(tmp_path / "a", name, kind, seed, tau, {}, evaluated=False)
        for folder, metrics in (("step-000768", {"eval/tau": tau}), ("step-000768-t1", {"eval/tau_expected": 1.5})):
            (tmp_path / "a" / name / "eval" / folder).mkdir(parents=True)
            (tmp_path / "a" / name / "eval" / folder / "summary.json").write_text(json.dumps({"metrics": metrics}))
    table.main([str(tmp_path / "a"), f"{tmp_path / 'a'}=again"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:4] for r in rows] == [["| dflash", "0,1", "2.500", "0.707"], ["| ours", "0", "4.000", "-"],
                                     ["| again", "0,1", "2.500", "0.707"]]
