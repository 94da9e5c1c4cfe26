"""Reporting: what evaluation and training results look like to a reader, in one room below the pipeline.

- summary.py: an evaluation's results onto the terminal and into W&B (the held-out table, suites, the train gap).
- plots.py: the PNG curves (matplotlib, imported when drawing).
- compare.py: runs compared without the W&B UI, `python -m dflash.report runs=[a,b]`: a table, plots, report.md
  and report.html, arms grouped over their seeds (`arm_rows`, which the sweeps' tables use too).
It reads result files (summary.json, metrics.jsonl, config.yaml) and imports nothing above base.
"""
