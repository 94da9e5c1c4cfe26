"""Compare runs without the W&B UI (table, PNG plots, report.md/html); see dflash.report.compare.

    python -m dflash.report runs=[run_a,run_b]            # names under runs/ or paths
    python -m dflash.report runs=all root=runs out=reports/lr-sweep
"""

import hydra

from dflash.cli import run, to_job
from dflash.config import register_configs
from dflash.report.compare import report

register_configs()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="report")
def main(cfg) -> None:
    run(report, to_job(cfg))


if __name__ == "__main__":
    main()
