"""Evaluate a drafter on held-out prompts; metrics land in the training run's W&B run.

    python evaluate.py                                 # latest checkpoint of the newest run, on its target
    python evaluate.py checkpoint=step20k run.name=my-run
    python evaluate.py checkpoint=best eval=live       # real speculative decoding, lossless check
    python evaluate.py checkpoint=/path/to/z-lab/drafter target=qwen3_8b
    python evaluate.py checkpoint=latest eval.compare=[/path/to/reference/drafter]
    python evaluate.py checkpoint=best eval=paper eval.suite.benchmarks_dir=/data/benchmarks   # per benchmark
    python evaluate.py checkpoint=best eval.dtype=float32   # default: the target's dtype, as servers run it

Results land in runs/<run>/eval/step-<N>/ at the run's own evaluation settings (its config.yaml: the same figures
as its in-run evaluation of that step), and beside it at other settings, in a folder that says what differs
(step-<N>-2prompts, step-<N>-t1-k20, step-<N>-live-24tokens; metrics as eval/2prompts/*): never over it.
"""

import hydra
from hydra.core.hydra_config import HydraConfig

from dflash.cli import names_target, refuse_moved_keys, run, to_job
from dflash.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg) -> None:
    job = to_job(cfg)  # config errors stop here, before anything heavy is imported
    from dflash.evaluate.runner import evaluate

    named = names_target(HydraConfig.get().overrides.task)
    run(lambda j: evaluate(j, target_from_run=not named), job)


if __name__ == "__main__":
    refuse_moved_keys()
    main()
