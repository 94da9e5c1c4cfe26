"""The report's per-arm table: runs that differ only in train.seed are one arm, averaged over its seeds."""

import math

from dflash.evaluate.report import arm_rows, differing_keys


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
