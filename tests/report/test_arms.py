"""The report's per-arm table: runs that differ only in train.seed are one arm, averaged over its seeds."""

import math

from dflash.report.compare import arm_rows, differing_keys


def run(name, objective, seed, tau, acc, ddtree):
    return {"name": name, "config": {"loss.objective": objective, "train.seed": seed, "run.name": name},
            "metrics": [], "evals": {4: {"metrics": {"eval/tau": tau - 0.5, "eval/acc@1": 0.0, "eval/ddtree@8": 1.0}},
                                     8: {"metrics": {"eval/tau": tau, "eval/acc@1": acc, "eval/ddtree@8": ddtree}}}}


def test_arms_average_their_seeds_final_eval():
    runs = [run("a0", "decay_ce", 0, 2.0, 0.5, 3.0), run("a1", "decay_ce", 1, 3.0, 0.7, 4.0),
            run("b0", "dpace", 0, 4.0, 0.9, 5.0), run("b1", "dpace", 1, 4.0, 0.9, 5.0),
            run("b2", "dpace", 2, 4.0, 0.9, 5.0)]
    keys = differing_keys(runs)
    assert keys == ["loss.objective", "train.seed"]
    arm_keys, rows = arm_rows(runs, keys)
    assert arm_keys == ["loss.objective"] and [r["arm"] for r in rows] == ["loss.objective=decay_ce",
                                                                          "loss.objective=dpace"]
    a, b = rows
    assert a["seeds"] == 2 and a["tau"] == 2.5 and math.isclose(a["tau sd"], math.sqrt(0.5))
    assert math.isclose(a["acc@1"], 0.6) and a["ddtree@8"] == 3.5 and a["best_tau"] == 2.5
    assert b["seeds"] == 3 and b["tau"] == 4.0 and b["tau sd"] == 0.0


def test_no_arm_table_without_repeated_seeds():
    runs = [run("a0", "decay_ce", 0, 2.0, 0.5, 3.0), run("b0", "dpace", 0, 4.0, 0.9, 5.0)]
    assert arm_rows(runs, differing_keys(runs))[1] == []


def test_dflash2_arms_carry_their_unary_and_oracle_taus():
    runs = [run("a0", "decay_ce", 0, 2.0, 0.5, 3.0), run("a1", "decay_ce", 1, 3.0, 0.7, 4.0),
            run("b0", "dpace", 0, 4.0, 0.9, 5.0), run("b1", "dpace", 1, 4.0, 0.9, 5.0)]
    for r, unary in zip(runs[2:], (3.0, 3.5)):
        r["evals"][8]["metrics"].update({"eval/tau_unary": unary, "eval/tau_oracle": 6.0})
    a, b = arm_rows(runs, differing_keys(runs))[1]
    assert a["tau_unary"] is None and b["tau_unary"] == 3.25 and b["tau_oracle"] == 6.0 and b["tau_oracle sd"] == 0.0


def test_a_run_evaluated_again_at_a_temperature_keeps_its_greedy_curve(tmp_path):
    """`python evaluate.py ... eval.decode.temperature=1.0` writes eval/step-000008-t1/ at the run's step: the report's
    final tau stays the in-run (greedy) evaluation of eval/step-000008/, not whichever folder sorts last."""
    import json

    from dflash.report.compare import load_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 8, "train/loss": 1.0}) + "\n")
    for folder, tau in (("step-000004", 1.5), ("step-000008", 2.0), ("step-000008-t1", 1.2),
                        ("step-000008-t0.6-unary", 1.1)):
        (tmp_path / "eval" / folder).mkdir(parents=True)
        summary = {"mode": "teacher_forced", "step": int(folder[5:11]), "metrics": {"eval/tau": tau}}
        (tmp_path / "eval" / folder / "summary.json").write_text(json.dumps(summary))
    run = load_run(tmp_path)
    assert {s: e["metrics"]["eval/tau"] for s, e in run["evals"].items()} == {4: 1.5, 8: 2.0}
