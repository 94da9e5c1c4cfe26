"""The speculative decoding engine is a room of its own (DESIGN §1): users import it, evaluate/ uses it."""
from tests.conftest import modules_loaded


def test_the_engine_imports_nothing_of_evaluate_or_train():
    """dflash.decode (the documented API) and every module of dflash.drafter.decoding load no module of evaluate/,
    train/, report/ or the plan: a script that decodes live needs none of them."""
    room = [f"dflash.drafter.decoding.{m}" for m in ("engine", "verify", "rules", "states", "ddtree", "sampling")]
    above = ("dflash.evaluate", "dflash.train", "dflash.report", "dflash.plan.")
    assert modules_loaded(["dflash.decode", *room], above) == []


def test_the_documented_entry_is_the_engine():
    import dflash.decode
    from dflash.drafter.decoding import engine

    assert dflash.decode.speculative_generate is engine.speculative_generate
    assert dflash.decode.greedy_generate is engine.greedy_generate
