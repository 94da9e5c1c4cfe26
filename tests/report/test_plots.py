"""Plots tell their lines apart."""

from dflash.report.plots import line_styles


def test_fifteen_runs_get_fifteen_distinct_line_styles():
    styles = line_styles(15)
    assert len({(s["color"], s["linestyle"]) for s in styles}) == 15
    assert styles[0]["color"] == styles[10]["color"] and styles[0]["linestyle"] != styles[10]["linestyle"]
